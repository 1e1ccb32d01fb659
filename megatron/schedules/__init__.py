"""Pipeline schedules: which F / B / W each pipeline stage runs when, as objects found by name.

Pure arithmetic, no torch, nothing else of megatron, so the config, the planner, the simulator
and the runtime all read the same facts from here:

- base.py         PipelineSchedule: one schedule's name, chunks per rank, V placement, split
                  backward, overlapped MoE pairs, action builder and textbook bubble; the
                  virtual-stage arithmetic; the messages each stage pair exchanges
- one_f_one_b.py  1F1B and interleaved 1F1B
- zero_bubble.py  ZB-H1, ZBV and DualPipeV
- registry.py     the registry --pipeline-schedule's choices come from; the default schedule
- sim.py          the lists run as a timeline: deadlock proof, step time, bubble, peak

Adding a schedule: a PipelineSchedule (its builder returns stage s's action list) and
`registry.register(it)`; the flag, the rules, the planner, the simulator and the runtime ask it.
"""
