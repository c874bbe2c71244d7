"""Planning: every choice of how a model trains, made in one place and returned as one frozen decision.

:mod:`~pipedp.decide.cut` cuts and places stages from block costs;
:mod:`~pipedp.decide.search` times the user's strongest alternative and
pipedp's plans within a budget; :mod:`~pipedp.decide.cpu` plans concurrent
CPU stages; :mod:`~pipedp.decide.rules` holds the rules across option groups;
:mod:`~pipedp.decide.choose` ties them together for the build. The user's
options keep meaning what the user asked; the :class:`Decision` is the
resolved value.
"""

from .config import Config
from .decision import Decision

__all__ = ["Config", "Decision"]
