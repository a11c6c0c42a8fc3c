"""Threads, latches and futures shared by the save and the load paths.

Owns: ``latch`` (a countdown event), ``workers`` (named job threads that never lose an
exception), ``priority`` (lowering a background thread's priority), ``signals`` (waits that
signal handlers can interrupt) and ``futures`` (the futures handed to callers).
May import: ``errors``. Nothing above it.
"""
