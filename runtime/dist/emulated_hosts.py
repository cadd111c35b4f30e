"""Several machines on this one, for tests and benchmarks of jobs over machines.

``EmulatedHosts(2, LinkSpec.parse("1gbit"))`` makes each host a network namespace of
its own behind an emulated link (``runtime.dist.emulated_link``: veth pairs shaped by
``tc`` to a bridge): a process started with ``command(host, argv)`` sees only that
host's address and reaches the others across the link, as a ``torchrun`` agent on a
machine of its own would. ``cut(host)`` takes the host's link down (a cable pulled);
``close`` deletes every namespace. Needs root and iproute2, like the links.
"""

from __future__ import annotations

import socket
import threading

from runtime.dist.emulated_link import (
    INTERFACE,
    EmulatedLinks,
    LinkSpec,
    join_namespace,
    run_tool,
)


class EmulatedHosts:
    """``hosts`` emulated machines joined by links of rate ``link`` (a context manager)."""

    def __init__(self, hosts: int, link: LinkSpec, subnet: str = "10.78.0") -> None:
        self.links = EmulatedLinks(hosts, link, subnet=subnet)
        self.hosts = hosts

    def up(self) -> EmulatedHosts:
        self.links.up()
        return self

    def address(self, host: int) -> str:
        return self.links.address(host)

    def namespace(self, host: int) -> str:
        return self.links.ranks[host]

    def command(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` run on ``host``; gloo told which interface is the host's network."""
        return [
            "ip", "netns", "exec", self.namespace(host),
            "env", f"GLOO_SOCKET_IFNAME={INTERFACE}", *argv,
        ]  # fmt: skip

    def free_port(self, host: int) -> int:
        """A TCP port free on ``host`` (asked from inside its namespace by a thread that
        enters it: a namespace is per thread until a process's threads all move)."""
        found: list[int | BaseException] = []

        def ask() -> None:
            try:
                join_namespace(self.links.namespace_path(host))
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind((self.address(host), 0))
                    found.append(s.getsockname()[1])
            except BaseException as exc:
                found.append(exc)

        thread = threading.Thread(target=ask)
        thread.start()
        thread.join()
        if isinstance(found[0], BaseException):
            raise found[0]
        return found[0]

    def cut(self, host: int) -> None:
        """Take ``host``'s link down: its packets stop, no connection is told."""
        run_tool("ip", "-n", self.namespace(host), "link", "set", INTERFACE, "down")

    def close(self) -> None:
        self.links.close()

    def __enter__(self) -> EmulatedHosts:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.close()
