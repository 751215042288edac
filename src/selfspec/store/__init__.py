"""Files on disk: atomic writes and directory checks (:mod:`~selfspec.store.files`), trained
artefacts (:mod:`~selfspec.store.artefacts`), the package-shipped offline assets
(:mod:`~selfspec.store.assets`, fetched with :mod:`~selfspec.store.simple_index`), one owner per
directory (:mod:`~selfspec.store.locks`), what every run records of where it ran
(:mod:`~selfspec.store.runinfo`) and a PNG that says what it shows (:mod:`~selfspec.store.figure`,
the report's and the training jobs' plots).
"""
