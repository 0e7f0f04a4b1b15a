"""epfabric for Python: DeepEP's Buffer API over epfabric daemons (docs/python.md).

    import epfabric
    buf = epfabric.Buffer.attach(socket, group, rank, token)   # a lease of a group the daemons own
    from epfabric import deep_ep                              # drop-in: deep_ep.Buffer(group, num_nvl_bytes, ...)
"""
from ._lib import EpfError, version
from .buffer import Buffer, DispatchHandle, UnavailableField, required_group_bytes
from .client import Client, DaemonInfo
from .low_latency import LowLatencyHandle
from .utils import Config, EventOverlap

__all__ = ["Buffer", "Client", "Config", "DaemonInfo", "DispatchHandle", "EpfError", "EventOverlap",
           "LowLatencyHandle", "UnavailableField", "required_group_bytes", "version"]
