"""Throwaway Redis servers for the tests: standalone ones and a local cluster of primaries."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_cluster_port() -> int:
    """A free port whose cluster bus port (the port + 10000) is free too."""
    while True:
        port = free_port()
        if port + 10_000 <= 65_535:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + 10_000))
                return port
            except OSError:
                pass


def ask(port: int, command: bytes, timeout_s: float = 0.5) -> bytes:
    """One inline command to a server on 127.0.0.1, and the start of its reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(command + b"\r\n")
        return s.recv(4096)


class RedisServer:
    """A throwaway ``redis-server`` on 127.0.0.1: no persistence, killed at the end."""

    def __init__(self, binary: str, directory: Path, *extra: str, port: int | None = None) -> None:
        self.binary, self.directory, self.extra = binary, directory, extra
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        cmd = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        cmd += ["--dir", str(self.directory), *self.extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                if ask(self.port, b"PING").startswith((b"+PONG", b"-NOAUTH")):  # a protected one says NOAUTH
                    return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


class LocalCluster:
    """A Redis Cluster of ``primaries`` nodes on 127.0.0.1 (no replicas, no persistence), made with
    ``redis-cli --cluster create``. Each node keeps its cluster config in a folder of its own, so a
    node restarted on its port rejoins with its slots (and none of its data)."""

    def __init__(self, binary: str, directory: Path, primaries: int = 3) -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            if os.environ.get("CI") == "true":
                pytest.fail("redis-cli is not installed; make setup installs it with redis-server")
            pytest.skip("redis-cli is not installed (it comes with redis-server's redis-tools)")
        self.cli = cli
        self.nodes = []
        for i in range(primaries):
            folder = directory / f"node{i}"
            folder.mkdir()
            # a short node timeout: a killed node is marked failed (and the cluster down) within seconds
            extra = (
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "1000",
            )
            self.nodes.append(RedisServer(binary, folder, *extra, port=free_cluster_port()))

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> LocalCluster:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        cmd = [self.cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"]
        subprocess.run(cmd, check=True, capture_output=True, timeout=60)
        self.wait_ok()
        return self

    def restart(self, i: int) -> None:
        node = self.nodes[i]
        node.kill()
        node.start()
        self.wait_ok()

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every node reports ``cluster_state:ok``."""
        deadline = time.monotonic() + timeout_s
        while not all(b"cluster_state:ok" in ask(n.port, b"CLUSTER INFO") for n in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the local cluster did not reach cluster_state:ok")
            time.sleep(0.05)

    def wait_down(self, timeout_s: float = 30.0) -> None:
        """Until a live node reports ``cluster_state:fail`` (after a node was killed)."""
        deadline = time.monotonic() + timeout_s
        live = [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]
        while not any(b"cluster_state:fail" in ask(n.port, b"CLUSTER INFO") for n in live):
            if time.monotonic() > deadline:
                raise RuntimeError("the local cluster did not notice the node that went away")
            time.sleep(0.05)

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()
