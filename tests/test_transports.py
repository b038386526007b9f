"""The transport registry (rl_jax.transfer.transports): every transport module is registered
under its class's name, and an unknown name is refused everywhere with the known ones named."""

import ast
import re
from pathlib import Path

import pytest

from rl_jax.transfer import transports
from rl_jax.transfer.config import PublisherConfig, PullerConfig
from rl_jax.transfer.errors import TransferError, TransportUnavailable, UnknownTransport
from rl_jax.transfer.publisher.core import Publisher
from rl_jax.transfer.puller.core import Puller
from rl_jax.transfer.transports import TRANSPORTS
from rl_jax.transfer.transports.base import STAGINGS, Transport

PACKAGE = Path(transports.__file__).parent


def _transport_classes_in(path: Path) -> list[str]:
    """Names of the classes deriving from ``Transport`` defined in the module at ``path``."""
    tree = ast.parse(path.read_text())
    return [node.name for node in tree.body if isinstance(node, ast.ClassDef)
            and any(getattr(base, "id", None) == "Transport" for base in node.bases)]


def test_the_registry_lists_every_transport_module_in_preference_order():
    modules = sorted(p for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "base"))
    found = {f"{p.stem}:{cls}" for p in modules for cls in _transport_classes_in(p)}
    assert len(found) == len(modules)  # one transport per module
    registered = {transports.get(name).__module__.rpartition(".")[2] + ":"
                  + transports.get(name).__name__ for name in transports.names()}
    assert registered == found
    assert transports.names() == TRANSPORTS == ("shm", "socket", "jax_transfer", "disk", "delta")
    for name in transports.names():
        cls = transports.get(name)
        assert issubclass(cls, Transport) and cls.name == name and cls.staging in STAGINGS
        assert not cls.streams or cls.staging == "host"  # streaming reads the staging slot
    assert transports.staged_on("host") == ("shm", "socket", "delta")
    assert [n for n in TRANSPORTS if not transports.get(n).checks_values] == ["jax_transfer"]
    assert [n for n in TRANSPORTS if transports.get(n).same_host] == ["shm"]


@pytest.mark.parametrize("name", ["pigeon", "staging", "", "SHM", None, ["shm"]])
def test_an_unknown_transport_name_is_refused_naming_the_known_ones(name):
    with pytest.raises(UnknownTransport) as info:
        transports.get(name)
    assert isinstance(info.value, TransportUnavailable) and isinstance(info.value, TransferError)
    message = str(info.value)
    assert message.startswith("unknown transport ")
    assert all(known in message for known in TRANSPORTS), message


def test_configs_naming_an_unknown_transport_are_refused_with_the_known_ones(tmp_path):
    known = re.escape(str(TRANSPORTS))
    with pytest.raises(ValueError, match=rf"transports must be a non-empty subset of {known}"):
        Publisher(PublisherConfig(transports=("shm", "pigeon"), staging_dir=str(tmp_path)))
    with pytest.raises(ValueError, match=rf"transport must be 'auto' or one of {known}, "
                                         r"got 'pigeon'"):
        Puller("http://127.0.0.1:9", {}, config=PullerConfig(transport="pigeon"))
    with pytest.raises(ValueError, match="the disk transport needs PublisherConfig.disk_dir"):
        Publisher(PublisherConfig(transports=("disk",), staging_dir=str(tmp_path)))
    assert list(tmp_path.iterdir()) == []  # refused before anything was made
