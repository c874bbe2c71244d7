"""The compiler side: depthwise-convolution kernels generated, tuned and exported with apache-tvm.

Nothing here is imported at training time; pipedp loads the exported
libraries with the TVM runtime only (``pipedp.ops``), and what both sides
need (problems, records, layouts, artifact checks) lives there. The parts
have one role each, as TVM's MetaSchedule separates them, so a part can be
replaced (a builder in worker processes, a runner on a machine without the
compiler) without touching the others:

- ``ops``, ``ops_nhwc``: the three operators as tensor expressions;
- ``space``: knobs and configs; ``template``: the schedule-template
  interface and its registry by (target kind, layout), filled by ``cpu``,
  ``cpu_nhwc``, ``cuda`` and ``cuda_nhwc`` (with ``cuda_common``: the GPU's
  limits and shared schedule steps); ``defaults``: a config per problem
  before any tuning;
- ``target``: compilation targets and the names records give them;
- ``builder``: config to compiled, loadable kernel (with ``streaming`` and
  ``offline_cuda``); ``runner``: check against torch and time;
  ``isolated``: both in worker processes with a time limit per candidate;
- ``cost_model``: the model, its features, the history between problems;
  ``tuner``: the search; ``database``: what the records say was measured
  and tuned (resume);
- ``remote``: build here, measure there (rounds of candidates measured by
  ``pipedp.ops.measure`` on a machine without the compiler);
- ``export``: one library per target; ``cli``: ``tune-kernels``;
- ``roofline``, ``allocator``: measuring aids; ``emulate``: a CUDA kernel
  run on the CPU, thread after thread, to check its indexing where there is
  no GPU.
"""
