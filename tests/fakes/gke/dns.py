"""The fake GKE's cluster DNS (kube-dns's part the pods use): A records for services and pods.

A pod's resolver is pointed here (its /etc/resolv.conf: `nameserver <gateway>`, Kubernetes'
search domains, `ndots:5`), as kube-dns is in a real pod. /etc/hosts alone is not enough: gRPC's
c-ares resolver (Ray's GCS client) asks the nameserver. Answers come from the same table the
kubelet writes into every pod's /etc/hosts; an unknown name is NXDOMAIN, a known name with no
IPv6 address an empty NOERROR.
"""

from __future__ import annotations

import socket
import struct
import threading


class Dns:
    """A UDP DNS server on (host, 53) answering from `records` (name -> IPv4 addresses)."""

    def __init__(self, host: str, port: int = 53) -> None:
        self.records: dict[str, list[str]] = {}
        self.lock = threading.Lock()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, port))
        self.sock.settimeout(0.5)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="fake-gke-dns", daemon=True)
        self._thread.start()

    def set(self, records: dict[str, list[str]]) -> None:
        with self.lock:
            self.records = {k.lower().rstrip("."): v for k, v in records.items()}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, addr = self.sock.recvfrom(4096)
            except (socket.timeout, OSError):
                continue
            try:
                reply = self.answer(data)
            except (ValueError, IndexError, struct.error):
                continue  # not a query we can read: a real server would say FORMERR; dropping is enough here
            try:
                self.sock.sendto(reply, addr)
            except OSError:
                pass

    def answer(self, query: bytes) -> bytes:
        """The reply to one query (one question, as resolvers send)."""
        qid, flags, qdcount = struct.unpack("!HHH", query[:6])
        if qdcount != 1:
            raise ValueError("one question")
        labels, i = [], 12
        while query[i]:
            n = query[i]
            labels.append(query[i + 1:i + 1 + n].decode("ascii", "replace"))
            i += 1 + n
        qtype, qclass = struct.unpack("!HH", query[i + 1:i + 5])
        question = query[12:i + 5]
        name = ".".join(labels).lower()
        with self.lock:
            addrs = self.records.get(name)
        rd = flags & 0x0100
        if addrs is None:
            return struct.pack("!HHHHHH", qid, 0x8000 | 0x0400 | rd | 0x0080 | 3, 1, 0, 0, 0) + question  # NXDOMAIN
        answers = b""
        count = 0
        if qtype in (1, 255) and qclass == 1:  # A (or ANY)
            for a in addrs:
                answers += b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 5, 4) + socket.inet_aton(a)
                count += 1
        return struct.pack("!HHHHHH", qid, 0x8000 | 0x0400 | rd | 0x0080, 1, count, 0, 0) + question + answers
