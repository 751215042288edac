"""What the runtime costs on a machine: pass timings (:mod:`~selfspec.measure.costs`) and the
machine's cost profile that prices a recorded step trace (:mod:`~selfspec.measure.profile`).

The runtime it measures is :mod:`selfspec.models`; what runs decoders to measure them (the profile
measurement, the runtime benchmark) is :mod:`selfspec.evaluation`, above the decoders.
"""
