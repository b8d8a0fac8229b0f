"""This process's host: logical CPU devices, memory, resource guards.

What is about the machine a worker runs on rather than about the
collectives between workers (engine/distribute/).
"""
