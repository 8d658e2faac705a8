"""The listening TCP sockets of a process tree, and whether each is on loopback.

`python tests/socket_util.py PID` prints them for a running `pdserve serve` (its PID): the listing
the README's "what binds where" refers to.
"""

from __future__ import annotations

import ipaddress
import sys
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class Listener:
    ip: str
    port: int
    pid: int
    name: str           # the process name: "gcs_server", "raylet", "ray::ServeReplica:app:Deployment", ...

    @property
    def loopback(self) -> bool:
        addr = ipaddress.ip_address(self.ip.split("%")[0])
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        return addr.is_loopback

    def __str__(self) -> str:
        return f"{self.ip}:{self.port:<6} {self.name} (pid {self.pid})"


def process_name(p: psutil.Process) -> str:
    """`p`'s name, for a Ray actor without the method it is running: Ray retitles an actor's
    process while a call runs ("ray::ServeReplica:pd:PrefillServer.record_routing_stats")."""
    name = p.name()
    return name.split(".", 1)[0] if name.startswith("ray::") else name


def listening(root_pid: int, include_root: bool = True) -> list[Listener]:
    """Every listening TCP socket of `root_pid` and its descendants, by process name then port.
    Processes that end while being read are skipped."""
    root = psutil.Process(root_pid)
    procs = ([root] if include_root else []) + root.children(recursive=True)
    out = []
    for p in procs:
        try:
            name = process_name(p)
            out += [Listener(c.laddr.ip, c.laddr.port, p.pid, name)
                    for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
    return sorted(out, key=lambda s: (s.name, s.port))


def report(listeners: list[Listener]) -> str:
    exposed = [s for s in listeners if not s.loopback]
    lines = [f"{len(listeners)} listening TCP sockets: {len(listeners) - len(exposed)} on loopback, "
             f"{len(exposed)} not"]
    return "\n".join(lines + [("  " if s.loopback else "! ") + str(s) for s in listeners])


if __name__ == "__main__":
    print(report(listening(int(sys.argv[1]))))
