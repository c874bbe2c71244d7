"""The planner's clocks: configurations lowered and run as the build runs them, timed.

:mod:`pipedp.decide` weighs plans through the protocols of
:mod:`pipedp.decide.measuring`; this package implements them on the lowering
(:mod:`pipedp.lower`) and the runtime, which the planner never imports.
"""
