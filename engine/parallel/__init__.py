"""Engines over several devices and hosts.

    sharding.py     tensor parallelism: mesh from a string, logical-axis rules, shardings
    replicas.py     data parallelism: DataParallelEngine, d EngineCores behind one interface
    distributed.py  multi-host: process 0 schedules, every process steps

May import: configs, models, engine's top level (core included). Never serving.
"""
