"""Communication for expert parallelism: dispatcher interface, layout math, backends."""

from .all_to_all import AllToAllDispatcher, AllToAllHandle, all_to_all_rows
from .dispatcher import DispatchHandle, Dispatcher, check_dispatch_args
from .layout import Layout, SlotOrder, dest_rows, layout_from_counts, sort_slots
from .local import LocalDispatcher
from .symm import ExchangeConfig, SymmDispatcher, SymmHandle, Tile, ep_buffers
from .symm.buffers import ExchangeError, SymmBuffers
from .topology import Topology

__all__ = [
    "Dispatcher", "DispatchHandle", "LocalDispatcher", "AllToAllDispatcher", "AllToAllHandle",
    "check_dispatch_args", "all_to_all_rows", "Layout", "SlotOrder", "layout_from_counts", "sort_slots", "dest_rows",
    "SymmDispatcher", "SymmHandle", "SymmBuffers", "ExchangeError", "ExchangeConfig", "Tile", "ep_buffers", "Topology",
]
