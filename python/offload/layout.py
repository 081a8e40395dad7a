"""The flat layout: where each trained parameter lies in the job's one flat space.

Parameters are laid out back to back, group by group in torch's order, those that require a
gradient only (frozen ones have no place on the servers); the library pads the space to its
``padded_length`` (ARCHITECTURE.md section 3), the padding belonging to the last group. From the
layout come what the C ABI takes (the groups as OffloadGroup, the parameters by name as
OffloadNamedTensor, range steps) and the gradient buckets, planned by the library's planner, the
one the C++ trainer's buckets use.
"""

from __future__ import annotations

import ctypes
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from offload import native

# A bucket of the flat space: [start, end) and the parameters (flat indices) it holds.
Bucket = Tuple[int, int, List[int]]


def split_names(params: Any) -> Tuple[Any, Optional[List[str]]]:
    """torch.optim's params argument with the names taken off: (name, parameter) pairs, what
    model.named_parameters() gives, alone or as the "params" of groups, become plain parameters
    (torch 1.13's Optimizer takes tensors only) and the names are returned in flat order."""
    if isinstance(params, torch.Tensor):
        return params, None
    params = list(params)
    if not params:
        return params, None
    grouped = isinstance(params[0], dict)
    groups = params if grouped else [{"params": params}]
    names: List[Optional[str]] = []
    stripped = []
    for g in groups:
        items = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        plain = []
        for item in items:
            named = isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
            names.append(item[0] if named else None)
            plain.append(item[1] if named else item)
        stripped.append({**{k: v for k, v in g.items() if k != "param_names"}, "params": plain})
    if all(n is None for n in names):
        return params, None
    if any(n is None for n in names):
        raise ValueError("some parameters come with names and some without: name every "
                         "parameter (model.named_parameters()) or none")
    return (stripped if grouped else stripped[0]["params"]), names  # type: ignore[return-value]


class FlatLayout:
    """The trained parameters of ``param_groups`` in the flat space (flat index = position in
    ``params``), and the frozen ones by (group, position).

    device: where the 16-bit weights go (None: the parameters' one device); with_values: a
    values source (materialize's) gives the parameters their values, so they may lie anywhere.
    """

    def __init__(self, param_groups: List[Dict[str, Any]], names: Optional[List[str]],
                 device: Any, with_values: bool) -> None:
        self.params: List[torch.nn.Parameter] = []
        self.offsets: List[int] = []
        self.shapes: List[torch.Size] = []
        self.packed: List[int] = []  # flat index -> index in param_groups order (torch's)
        self.frozen: List[Tuple[int, int]] = []  # (group, position) of each frozen parameter
        self.group_bounds: List[Tuple[int, int]] = []  # (start, length) of each group
        offset = 0
        packed = 0
        source_device = None
        for gi, g in enumerate(param_groups):
            start = offset
            if not g["params"]:
                raise ValueError("a parameter group without parameters")
            for pj, p in enumerate(g["params"]):
                packed += 1
                if not p.is_floating_point():
                    raise TypeError(f"parameter of dtype {p.dtype} is not floating point: the "
                                    "optimizer servers train floating-point parameters only")
                if p.is_sparse:
                    raise TypeError("sparse parameters are not supported")
                if source_device is None:
                    source_device = p.device
                elif p.device != source_device and device is None and not with_values:
                    raise ValueError(f"parameters on {source_device} and {p.device}: keep every "
                                     "parameter of one optimizer on one device, or pass device=")
                if not p.requires_grad:
                    self.frozen.append((gi, pj))
                    continue
                self.params.append(p)
                self.offsets.append(offset)
                self.shapes.append(p.shape)
                self.packed.append(packed - 1)
                offset += p.numel()
            self.group_bounds.append((start, offset - start))
        if offset == 0:
            raise ValueError("no parameter requires a gradient: there is nothing to train")
        self.num_params = offset
        # The servers' parameter groups: those with a parameter to train.
        self.trained = [gi for gi, (_, n) in enumerate(self.group_bounds) if n > 0]
        self.device = torch.device(device) if device is not None else source_device
        if self.device.type == "meta" and with_values:
            self.device = torch.device("cpu")  # materialize()'s model, without a device=
        if self.device.type == "meta":
            raise ValueError("the parameters are on the meta device: build the optimizer with "
                             "offload.torch.materialize(model, ...), which gives them values")
        if names is not None and len(names) != packed:
            raise ValueError("name every parameter or none")
        self.names: Optional[List[str]] = None if names is None else [names[k]
                                                                      for k in self.packed]

    def __len__(self) -> int:
        return len(self.params)

    def numel(self, i: int) -> int:
        return self.shapes[i].numel()

    def where(self, param_groups: List[Dict[str, Any]]) -> List[Tuple[int, int]]:
        """Per index in param_groups order: its (group, position)."""
        return [(gi, pj) for gi, g in enumerate(param_groups) for pj in range(len(g["params"]))]

    # ---------------------------------------------------------------------- what the C ABI takes

    def groups(self, param_groups: List[Dict[str, Any]], kind: int) -> ctypes.Array:
        """The job's groups: each trained group's run of the flat space and hyper-parameters."""
        out = (native.OffloadGroup * len(self.trained))()
        for i, gi in enumerate(self.trained):
            g, (start, length) = param_groups[gi], self.group_bounds[gi]
            out[i] = native.OffloadGroup(start, length, kind, float(g["lr"]),
                                         float(g["betas"][0]), float(g["betas"][1]),
                                         float(g["eps"]), float(g["weight_decay"]))
        return out

    def lrs(self, param_groups: List[Dict[str, Any]]) -> List[float]:
        """Each trained group's lr now, as a commit takes them."""
        return [float(param_groups[gi]["lr"]) for gi in self.trained]

    def named_tensors(self, names: List[str]) -> Tuple[ctypes.Array, List[Any]]:
        """The parameters by name (checkpoints), and what must outlive the call."""
        keep: List[Any] = []
        array = (native.OffloadNamedTensor * len(names))()
        for i, name in enumerate(names):
            encoded = name.encode()
            shape = (ctypes.c_int64 * max(1, len(self.shapes[i])))(*self.shapes[i])
            keep += [encoded, shape]
            array[i] = native.OffloadNamedTensor(encoded, self.offsets[i], len(self.shapes[i]),
                                                 shape)
        return array, keep

    def range_step_runs(self, unused: Sequence[int], adam_step: int,
                        lag: Sequence[int]) -> List[List[int]]:
        """[offset, n, t] runs of what torch does per parameter in the coming update (adam_step
        applied so far; lag: the updates each parameter missed): a parameter without a gradient
        is not updated (t 0), and one that missed updates before takes its own bias-correction
        step; neighbours in the flat space with the same t go as one run, and the job's own t
        needs none."""
        skip = set(unused)
        runs: List[List[int]] = []
        for i, off in enumerate(self.offsets):
            t = 0 if i in skip else adam_step + 1 - lag[i]
            if t == adam_step + 1:
                continue  # the job's own
            n = self.numel(i)
            if runs and runs[-1][0] + runs[-1][1] == off and runs[-1][2] == t:
                runs[-1][1] += n
            else:
                runs.append([off, n, t])
        return runs

    def buckets(self, bucket_elements: int, padded_length: int) -> List[Bucket]:
        """[start, end) runs of whole parameters of about bucket_elements, in flat order,
        covering [0, padded_length): the library's greedy plan of the parameters, and the padding
        after the last parameter in the last bucket (one of its own when that one is full)."""
        target = max(1, bucket_elements)
        bucket_of = native.plan_buckets([self.numel(i) for i in range(len(self))], target)
        out: List[Bucket] = []
        for i, b in enumerate(bucket_of):
            if b == len(out):
                out.append((self.offsets[i], self.offsets[i], []))
            start, _, members = out[b]
            members.append(i)
            out[b] = (start, self.offsets[i] + self.numel(i), members)
        start, end, members = out[-1]
        if end - start < target:
            out[-1] = (start, max(end, padded_length), members)
        elif end < padded_length:
            out.append((end, padded_length, []))
        return out

    # ---------------------------------------------------------------------- names and groups

    def param_names(self, model: Optional[torch.nn.Module]) -> List[str]:
        """The names the state is saved under: model's names for the parameters, else the names
        the optimizer was built with (named_parameters()), else each parameter's flat index."""
        if model is not None:
            by_id = {id(p): n for n, p in model.named_parameters()}
            names = []
            for i, p in enumerate(self.params):
                if id(p) not in by_id:
                    raise ValueError(f"parameter {i} (shape {tuple(self.shapes[i])}) of this "
                                     "optimizer is not a parameter of the model given")
                names.append(by_id[id(p)])
            return names
        if self.names is not None:
            return list(self.names)
        return [f"param.{i}" for i in range(len(self.params))]

    def packed_groups(self, param_groups: List[Dict[str, Any]],
                      names: Optional[List[str]] = None) -> List[Dict[str, Any]]:
        """param_groups as torch packs them: every hyper-parameter, and the parameters as their
        indices (or names)."""
        groups = []
        index = 0
        for g in param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            count = len(g["params"])
            # Names are the trained parameters' (flat order); frozen ones have no state.
            packed["params"] = (list(range(index, index + count)) if names is None else
                                [names[i] for i, k in enumerate(self.packed)
                                 if index <= k < index + count])
            index += count
            groups.append(packed)
        return groups
