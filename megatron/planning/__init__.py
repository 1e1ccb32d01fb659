"""Parallel-layout planning: memory and step-time models of a layout, and the search over the
layouts the configuration rules accept (tools/plan_parallel.py, pretrain_gpt2.py --auto-parallel).

    memory.py     bytes per rank: parameters, gradients, optimizer state, activations
    timing.py     seconds per step: compute, TP / DP / PP communication, bubble, recompute
    enumerate.py  every valid layout for a world size, ranked; the --auto-parallel choice

Imports only megatron.config (the planner must run before any process group or model exists).
"""
