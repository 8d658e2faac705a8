"""A multi-node Ray cluster on one machine: cluster.local.yaml under Ray's real autoscaler (v1) and its
fake multi-node provider, which launches each worker "node" as a separate raylet on this machine.

Life cycle (`LocalCluster.start` ... `stop`):
  1. fill    a copy of cluster.local.yaml in a fresh temp dir, with `provider.gcs_address` = this
             machine's address and a free port (`ray up` does not work with this provider)
  2. start   `RAY_FAKE_CLUSTER=1 ray start --head --autoscaling-config=<copy>` with RAY_TMPDIR = that
             dir: the head (no fixed port but the GCS's free one) and its autoscaler, which launches
             each worker type's `min_workers` and then follows the demand
             Ray's token authentication is on, with a fresh token in that dir (RAY_AUTH_TOKEN_PATH)
  3. use     `connect()` (this process's driver; or a subprocess with `driver_env()` calling
             `ray.init(address=cluster.address)`); `nodes()` says which node is which type
  4. stop    every process of this cluster, by process id: those whose command line or environment names
             the temp dir (the head's, the fake nodes' raylets and agents, every worker), SIGTERM then
             SIGKILL; then the temp dir. Never `ray stop` (it kills every Ray on the machine).

The caller's environment is left as it was (no RAY_ADDRESS): a later plain `ray.init()` starts its own
cluster, not this one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HEAD_TYPE = "ray.head.default"
# Not custom resources: what every node has or Ray adds itself.
_BUILTIN = {"CPU", "GPU", "memory", "object_store_memory"}


def node_ip() -> str:
    from ray.util import get_node_ip_address
    return get_node_ip_address()


def fill_config(source: Path, dest_dir: Path, gcs_address: str) -> Path:
    """Write `source` with `provider.gcs_address` set into `dest_dir`; return the copy's path."""
    config = yaml.safe_load(Path(source).read_text())
    config["provider"]["gcs_address"] = gcs_address
    dest = Path(dest_dir) / "cluster.yaml"
    dest.write_text(yaml.safe_dump(config, sort_keys=False))
    return dest


def node_type_of(resources: dict[str, float], config: dict) -> str | None:
    """The node type (of `config`'s available_node_types) whose custom resources a live node offers;
    the head type for the node with Ray's head marker."""
    if "node:__internal_head__" in resources:
        return HEAD_TYPE
    for name, t in config["available_node_types"].items():
        custom = set(t.get("resources", {})) - _BUILTIN
        if custom and custom <= set(resources):
            return name
    return None


@dataclasses.dataclass
class LocalCluster:
    """A started fake multi-node cluster; `stop()` ends every process of it (idempotent)."""
    config: dict
    tmp_dir: Path
    address: str
    update_interval_s: int = 1

    @classmethod
    def start(cls, source: str | Path, update_interval_s: int = 1, timeout_s: float = 60) -> "LocalCluster":
        """Steps 1-2. `update_interval_s`: the autoscaler's loop period (Ray's default 5 s).
        Raises RuntimeError (after cleaning up) when the head does not start."""
        from serving import ray_compat
        free_port = ray_compat.free_port
        tmp_dir = Path(tempfile.mkdtemp(prefix="pdlc-"))
        address = f"{node_ip()}:{free_port()}"
        filled = fill_config(Path(source), tmp_dir, address)
        config = yaml.safe_load(filled.read_text())
        cluster = cls(config, tmp_dir, address, update_interval_s)
        head = config["available_node_types"][HEAD_TYPE]["resources"]
        custom = {k: v for k, v in head.items() if k not in _BUILTIN}
        cmd = [str(Path(sys.executable).with_name("ray")), "start", "--head", f"--port={address.rsplit(':', 1)[1]}",
               f"--autoscaling-config={filled}", f"--num-cpus={int(head.get('CPU', 0))}",
               f"--num-gpus={int(head.get('GPU', 0))}", "--include-dashboard=false", "--disable-usage-stats",
               # no fixed ports: Ray's defaults for these are 8265, 10001 and 52365 (and 44217 and
               # 44227 for the head's metrics: ray_compat.head_ports_env below)
               f"--dashboard-port={free_port()}", f"--ray-client-server-port={free_port()}",
               f"--dashboard-agent-listen-port={free_port()}"]
        if "object_store_memory" in head:
            cmd.append(f"--object-store-memory={int(head['object_store_memory'])}")
        if custom:
            cmd.append(f"--resources={json.dumps(custom)}")
        token = tmp_dir / "auth_token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        env = {**os.environ, **ray_compat.serve_node_env(), **ray_compat.head_ports_env(), **cluster.driver_env(),
               "RAY_TMPDIR": str(tmp_dir),
               "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": str(update_interval_s)}
        env.pop("RAY_ADDRESS", None)
        try:
            subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=timeout_s)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            cluster.stop()
            out = getattr(exc, "stderr", "") or ""
            raise RuntimeError(f"ray start --head failed: {exc}\n{out[-2000:]}") from exc
        except BaseException:          # Ctrl-C while it starts: leave nothing behind
            cluster.stop()
            raise
        return cluster

    def driver_env(self) -> dict[str, str]:
        """What a driver's environment needs to connect (token authentication with this cluster's token);
        set it before the driver's first `ray.init`."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.tmp_dir / "auth_token")}

    def connect(self, log_to_driver: bool = False) -> None:
        """`ray.init` this process to the cluster, with its token (sets `driver_env()` in os.environ).
        The workers' logs stay in `tmp_dir` unless `log_to_driver` (every fake node's log monitor tails
        the one shared session directory, so the driver would print each line once per node)."""
        import ray

        from serving import ray_compat
        os.environ.update(self.driver_env())
        ray_compat.reload_auth_config()
        ray.init(address=self.address, logging_level="WARNING", log_to_driver=log_to_driver)

    def nodes(self) -> list[dict]:
        """The alive nodes: [{"node_id", "type", "resources"}] (needs a connected driver)."""
        import ray
        return [{"node_id": n["NodeID"], "type": node_type_of(n["Resources"], self.config),
                 "resources": n["Resources"]} for n in ray.nodes() if n["Alive"]]

    def node_counts(self) -> dict[str, int]:
        counts = {name: 0 for name in self.config["available_node_types"]}
        for n in self.nodes():
            counts[n["type"]] = counts.get(n["type"], 0) + 1
        return counts

    def wait_for_nodes(self, want: dict[str, int], timeout_s: float = 120) -> bool:
        """Wait until at least `want[type]` nodes of each type are alive."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            counts = self.node_counts()
            if all(counts.get(t, 0) >= n for t, n in want.items()):
                return True
            time.sleep(0.5)
        return False

    def autoscaler_events(self) -> list[tuple[float, str]]:
        """The autoscaler's event summaries so far ("Adding 1 node(s) of type decode_gpu.", "Removing 1 nodes
        of type decode_gpu (idle)."), as (epoch seconds, text), from its log in the temp dir."""
        log = self.tmp_dir / "ray" / "session_latest" / "logs" / "monitor.log"
        events = []
        for line in (log.read_text(errors="replace").splitlines() if log.exists() else []):
            stamp, sep, text = line.partition(":event_summary:")
            if sep:
                try:
                    at = datetime.datetime.strptime(stamp[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                except ValueError:
                    continue
                events.append((at, text.strip()))
        return events

    def pids(self) -> list[int]:
        """Processes of this cluster: their command line or environment names the temp dir."""
        mark, skip = str(self.tmp_dir).encode(), _ancestors()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in skip:
                continue
            try:
                if mark in (entry / "cmdline").read_bytes() or mark in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue       # gone, or not ours
        return found

    def stop(self, grace_s: float = 10, keep_logs: Path | None = None) -> list[int]:
        """Step 4: SIGTERM every process of the cluster but the GCS, then the GCS once they are gone (a
        raylet told to stop while the GCS is also going waits out its grace for it), SIGKILL what is
        left after `grace_s`; remove the temp dir (its Ray logs copied to `keep_logs` first, if given).
        Returns the pids that were still alive at the end (expected: none)."""
        deadline = time.monotonic() + grace_s
        for sig, chosen in ((signal.SIGTERM, lambda pid: not _is_gcs(pid)), (signal.SIGTERM, lambda pid: True),
                            (signal.SIGKILL, lambda pid: True)):
            if sig == signal.SIGKILL:
                deadline = time.monotonic() + 5
            for pid in filter(chosen, self.pids()):
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
            while any(map(chosen, self.pids())) and time.monotonic() < deadline:
                time.sleep(0.2)
        left = self.pids()
        if keep_logs is not None:
            shutil.copytree(self.tmp_dir / "ray" / "session_latest" / "logs", keep_logs, dirs_exist_ok=True)
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        return left


def _is_gcs(pid: int) -> bool:
    """The process is the cluster's GCS server."""
    try:
        return b"gcs_server" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return False


def _ancestors() -> set[int]:
    """This process and its parents (never signalled, whatever their environment)."""
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids
