"""Megatron-LM's pickled files (common.pt, model_optim_rng.pt, distrib_optim.pt, a .distcp's byte items) read
without Megatron-LM installed and without running code from the file.

A Megatron checkpoint pickles Megatron's own classes (the `args` Namespace holds enums such as ModelType and
AttnBackend, the RNG tracker holds its state objects). torch.load(weights_only=True) refuses them and a plain
unpickler would import Megatron. Here tensors, containers, argparse/SimpleNamespace and torch's own safe globals
(torch._weights_only_unpickler's list) load as themselves, and every other global becomes an `Opaque` stand-in
that records its name and what it was built from, so an enum argument still reads as its value.
"""
from __future__ import annotations

import argparse
import builtins
import io
import pickle
import types
import zipfile
import torch
from torch import _weights_only_unpickler

from engine.config import ConfigError

_PLAIN = {("argparse", "Namespace"): argparse.Namespace, ("types", "SimpleNamespace"): types.SimpleNamespace,
          ("builtins", "slice"): slice, ("builtins", "frozenset"): frozenset, ("builtins", "range"): range}


class Opaque:
    """A pickled object of a class this process does not load: its name, its constructor arguments, its state."""
    qualname = "?"

    def __new__(cls, *args, **kwargs):
        self = object.__new__(cls)
        self.args, self.state = args, None
        return self

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state

    @property
    def value(self):
        """An enum member's value (its one constructor argument), else the object itself."""
        return self.args[0] if len(self.args) == 1 else self

    def __repr__(self) -> str:
        return f"<{self.qualname}{self.args!r}>"


_OPAQUE: dict = {}


def _stand_in(module: str, name: str) -> type:
    key = f"{module}.{name}"
    if key not in _OPAQUE:
        _OPAQUE[key] = type(name, (Opaque,), {"qualname": key})
    return _OPAQUE[key]


class _Unpickler(pickle.Unpickler):
    _allowed = _weights_only_unpickler._get_allowed_globals()

    def find_class(self, module, name):
        if (module, name) in _PLAIN:
            return _PLAIN[(module, name)]
        if f"{module}.{name}" in self._allowed:
            return self._allowed[f"{module}.{name}"]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "builtins" and name in ("set", "complex", "bytearray", "dict", "list", "tuple"):
            return getattr(builtins, name)
        return _stand_in(module, name)


PICKLE_MODULE = types.ModuleType("ternion_megatron_pickle")
PICKLE_MODULE.Unpickler = _Unpickler
PICKLE_MODULE.load = lambda f, **kw: _Unpickler(f, **kw).load()
PICKLE_MODULE.__name__ = "ternion_megatron_pickle"


def load_file(path: str, what: str, mmap: bool = False):
    """torch.load of a Megatron file, its tensors on the CPU (memory-mapped with `mmap`: read as used); a damaged
    or truncated file is one ConfigError line naming it."""
    try:
        return torch.load(path, map_location="cpu", pickle_module=PICKLE_MODULE, weights_only=False,
                          mmap=mmap and zipfile.is_zipfile(path))
    except FileNotFoundError:
        raise ConfigError(f"{path} is missing ({what})") from None
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as e:
        raise ConfigError(f"{path} is truncated or not a PyTorch file ({what}: {str(e).splitlines()[0]})") from None


def load_bytes(data: bytes) -> object:
    """A pickled object from a .distcp byte item (Megatron's sharded objects)."""
    return torch.load(io.BytesIO(data), map_location="cpu", pickle_module=PICKLE_MODULE, weights_only=False)
