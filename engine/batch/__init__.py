"""A step's plan -> fixed-shape arrays: the boundary between the host and the device.

    builder.py   BatchShape, StepBatch, PackedBatch, BuiltStep and the BatchBuilder

May import: configs, engine's top level, engine/sched/, engine/sampling/. Never serving.
"""
