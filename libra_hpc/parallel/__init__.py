"""EARL's two mechanisms, pure: the context-length-aware TP selector (:mod:`.selector`) and
layout-aware data dispatch (:mod:`.dispatch`). The planner and the runtime use them; they
import neither."""

from libra_hpc.parallel.dispatch import DirectDispatch, GatherScatterDispatch, balance, least_loaded, make_dispatcher
from libra_hpc.parallel.selector import TpChoice, TpSelector, TpTable, choose_by_cost

__all__ = ["DirectDispatch", "GatherScatterDispatch", "TpChoice", "TpSelector", "TpTable", "balance",
           "choose_by_cost", "least_loaded", "make_dispatcher"]
