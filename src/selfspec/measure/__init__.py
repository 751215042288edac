"""What the runtime costs on a machine: pass timings (:mod:`~selfspec.measure.costs`), the
machine's cost profile that prices a recorded step trace (:mod:`~selfspec.measure.profile`) and a
job's peak memory, estimated before its model loads and measured (:mod:`~selfspec.measure.peak`).

The runtime it measures is :mod:`selfspec.models`; what runs decoders to measure them (the profile
measurement, the runtime benchmark) is :mod:`selfspec.evaluation`, above the decoders.
"""
