"""Cutting a model into blocks, measuring them, and balancing them into stages."""

from .balance import balance, stage_costs
from .blocks import Block, Chain, blocks_of
from .check import check_chain
from .profile import BlockProfile, estimate_blocks, profile_blocks

__all__ = [
    "balance", "stage_costs", "Block", "Chain", "blocks_of", "check_chain",
    "BlockProfile", "estimate_blocks", "profile_blocks",
]
