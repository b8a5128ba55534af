"""The rendezvous store listens on the master address only, not on every interface."""
import datetime
import socket
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from spd.distributed.launch import _open_store
from spd.errors import SPDError


def _listening_addresses(port: int) -> list[str]:
    """Local addresses of the sockets listening on `port` (Linux /proc/net/tcp*, hex)."""
    out = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(name).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.rsplit(":", 1)
            if int(p, 16) == port and state == "0A":  # 0A: LISTEN
                out.append(addr)
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net (Linux only)")
def test_store_listens_on_loopback_only_and_serves_clients():
    store = _open_store("127.0.0.1", 0, 10.0)
    assert _listening_addresses(store.port) == ["0100007F"]  # 127.0.0.1, not 0.0.0.0 / [::]
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False,
                           timeout=datetime.timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("k") == b"v"


def test_a_busy_port_and_a_bad_address_are_clear_errors():
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        with pytest.raises(SPDError, match="is busy"):
            _open_store("127.0.0.1", busy.getsockname()[1], 5.0)
    finally:
        busy.close()
    with pytest.raises(SPDError, match="cannot listen on no-such-host.invalid"):
        _open_store("no-such-host.invalid", 0, 5.0)
