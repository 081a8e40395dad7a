"""The optimizer's state in and out: ``state_dict`` / ``load_state_dict`` (torch's layout, the
state read into this process) and ``save_checkpoint`` / ``load_checkpoint`` (files by parameter
name, streamed by the library between the servers and the disk).

Both carry the counters, the loss scaler and the groups' hyper-parameters. Both may be taken
between two ``backward()`` calls of a step: the step's gradient sum so far is saved too, and a
resumed run goes on with the step as if it had never stopped (the mid-accumulation resume). A
load is checked against this optimizer's parameters before anything changes, and the servers
apply it only when every value was accepted: a refused state changes nothing.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from offload import checkpoint as ckpt
from offload import job as _job
from offload import native
from offload.commits import Commits
from offload.gradients import GradientPath
from offload.layout import FlatLayout
from offload.native import NativeOptimizer, OffloadError
from offload.ranks import Ranks
from offload.weights import Weights

# The hyper-parameters fixed when the job is created on the servers; lr may change every step.
_FIXED = ("betas", "eps", "weight_decay")
_TENSORS = (("master", native.MASTER), ("exp_avg", native.EXP_AVG),
            ("exp_avg_sq", native.EXP_AVG_SQ))


class OptimizerState:
    """State I/O of one optimizer (named ``name``, of ``dtype`` weights), over its parts."""

    def __init__(self, name: str, dtype: torch.dtype, param_groups: List[Dict[str, Any]],
                 layout: FlatLayout, opt: NativeOptimizer, ranks: Ranks, weights: Weights,
                 commits: Commits, gradients: GradientPath, lock: threading.RLock) -> None:
        self._name, self._dtype, self._param_groups = name, dtype, param_groups
        self._layout, self._native, self._ranks = layout, opt, ranks
        self._weights, self._commits, self._grads = weights, commits, gradients
        self._lock = lock

    def read(self, tensor: int, offset: int, n: int) -> torch.Tensor:
        """(n,) fp32 of one state tensor (native.MASTER, ...) for flat [offset, offset + n)."""
        out = torch.empty(n, dtype=torch.float32)
        self._native.read_state(tensor, offset, out)
        return out

    # ------------------------------------------------------------------------------ state_dict

    def state_dict(self) -> Dict[str, Any]:
        layout, commits = self._layout, self._commits
        with self._lock:
            accumulated = None
            if self._native.in_step():
                # Between two backward() calls of a step: its gradients' sum so far is saved too.
                accumulated = self._accumulated()
            else:
                # The delayed update lands first: a run that resumes from this state computes
                # with the weights this one computes with from now on.
                commits.apply_pending()
            adam_step = commits.adam_step
            state: Dict[int, Dict[str, torch.Tensor]] = {}
            for i, off in enumerate(layout.offsets):
                n, shape = layout.numel(i), layout.shapes[i]
                state[layout.packed[i]] = {
                    "step": torch.tensor(float(adam_step - commits.lag[i])),
                    "exp_avg": self.read(native.EXP_AVG, off, n).view(shape),
                    "exp_avg_sq": self.read(native.EXP_AVG_SQ, off, n).view(shape),
                    "master": self.read(native.MASTER, off, n).view(shape)}
        scale, clean, skipped = self._native.get_scaler()
        meta = {"format": 1, "dtype": str(self._dtype), "num_params": layout.num_params,
                "completed_step": commits.step, "adam_step": adam_step, "loss_scale": scale,
                "clean_steps": clean, "skipped_steps": skipped}
        if accumulated is not None:
            meta["accumulated"] = accumulated
        return {"state": state, "param_groups": layout.packed_groups(self._param_groups),
                "offload": meta}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        layout = self._layout
        meta = state_dict.get("offload")
        if not isinstance(meta, dict) or meta.get("format") != 1:
            raise ValueError("not a state_dict of an offload.torch optimizer (no 'offload' "
                             "entry of format 1)")
        if meta["dtype"] != str(self._dtype):
            raise ValueError(f"the state is of a {meta['dtype']} optimizer, this one is "
                             f"{self._dtype}")
        if meta["num_params"] != layout.num_params:
            raise ValueError(f"the state is of a model of {meta['num_params']} parameters, this "
                             f"one has {layout.num_params}")
        groups = state_dict["param_groups"]
        self._fixed_hyperparameters_match(groups)
        accumulated = meta.get("accumulated")
        if accumulated is not None:
            self._check_accumulated(accumulated)
        state = state_dict["state"]
        for i, shape in enumerate(layout.shapes):
            s = state.get(layout.packed[i])
            if s is None:
                raise ValueError(f"the state has nothing for parameter {layout.packed[i]}")
            for name, _ in _TENSORS:
                t = s.get(name)
                if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != torch.float32:
                    raise ValueError(
                        f"parameter {layout.packed[i]}: {name} is "
                        f"{None if not isinstance(t, torch.Tensor) else (t.dtype, tuple(t.shape))}"
                        f", expected float32 of shape {tuple(shape)}: the state is of another "
                        "model")
        completed, adam = int(meta["completed_step"]), int(meta["adam_step"])
        lags = []
        for i in range(len(layout)):
            step = state[layout.packed[i]].get("step", adam)
            step = int(step.item() if isinstance(step, torch.Tensor) else step)
            if not 0 <= step <= adam:
                raise ValueError(f"parameter {layout.packed[i]}: step {step} is outside [0, "
                                 f"{adam}], the updates applied")
            lags.append(adam - step)

        def load() -> None:
            self._native.load_begin(True, completed, adam)
            for i, off in enumerate(layout.offsets):
                for name, tensor in _TENSORS:
                    t = state[layout.packed[i]][name].detach().reshape(-1).to("cpu").contiguous()
                    self._native.load_chunk(tensor, off, t)
            self._native.load_finish()

        self._load_with_scaler((meta["loss_scale"], meta["clean_steps"], meta["skipped_steps"]),
                               load, "loading the state")
        self._commits.restore(completed, adam, lags)
        self._restore_groups(groups)
        self._weights.from_state([state[layout.packed[i]]["master"] for i in range(len(layout))])
        if accumulated is not None:
            self._resume_accumulation(accumulated)

    # ------------------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, path: Optional[str], model: Optional[torch.nn.Module],
                        keep: int) -> str:
        path = checkpoint_path(path, "save_checkpoint")
        layout, commits = self._layout, self._commits
        names = layout.param_names(model)
        array, keep_alive = layout.named_tensors(names)
        record = {"optimizer": self._name, "dtype": str(self._dtype),
                  "param_groups": layout.packed_groups(self._param_groups, names)}
        with self._lock:
            # Between two backward() calls of a step, the library adds the step's gradient sum
            # so far to the files, and the record says how to go on with the step.
            if self._native.in_step():
                record["accumulated"] = self._mid_accumulation("save_checkpoint()")
            else:
                commits.apply_pending()  # the counters and lags below are then the shards'
            record["param_steps"] = {names[i]: commits.adam_step - lag
                                     for i, lag in enumerate(commits.lag) if lag}
            front_end = json.dumps(record)
            directory, error = "", None
            if self._ranks.rank == 0:
                directory, error = native.attempt(lambda: self._native.save_checkpoint(
                    path, array, commits.step, commits.adam_step, front_end, int(keep)))
            self._ranks.agree(error, "saving the checkpoint")
        del keep_alive
        directory = self._ranks.from_rank0(directory)
        if _job.active():
            _job._checkpointed(directory, commits.step)
        return directory

    def load_checkpoint(self, path: Optional[str], model: Optional[torch.nn.Module]
                        ) -> Optional[str]:
        layout, ranks = self._layout, self._ranks
        if path is None:
            path = _job.checkpoint_dir()
            if path is None:
                return None  # no job directory: nothing to resume from (a script run by hand)
            # rank 0's answer: the others may not see its directory
            if not ranks.from_rank0(ckpt.has_checkpoint(path) if ranks.rank == 0 else False):
                return None
        names = layout.param_names(model)
        found: List[Any] = [None, None, None]  # directory, manifest text, error
        if ranks.rank == 0:
            try:
                found[0], found[1] = ckpt.find_manifest(path)
            except (OSError, OffloadError) as e:
                found[2] = str(e)
        found = ranks.from_rank0(found)
        if found[2] is not None:
            raise FileNotFoundError(found[2])
        directory, manifest = found[0], ckpt.parse_manifest(found[1], found[0])
        if manifest.dtype != self._dtype:
            raise ValueError(f"checkpoint {directory} is of {manifest.dtype} weights, this "
                             f"optimizer's are {self._dtype}")
        array, keep_alive = layout.named_tensors(names)
        native.check_checkpoint(directory, array)
        self._fixed_hyperparameters_match(manifest.param_groups, names)
        lags = [manifest.adam_step - manifest.step_of(name) for name in names]
        if any(not 0 <= lag <= manifest.adam_step for lag in lags):
            raise ValueError(f"checkpoint {directory}: a parameter's step is outside [0, "
                             f"{manifest.adam_step}], the updates applied")
        accumulated = None
        if manifest.accumulated is not None:
            # Saved between two micro-batches: its gradient sum so far, read (and checked)
            # before anything is loaded.
            if ranks.world > 1:
                raise ValueError(f"checkpoint {directory} was saved between two micro-batches of "
                                 "a step, which resumes on one rank only")
            grad_sum = torch.empty(layout.num_params, dtype=torch.float32)
            native.read_checkpoint_gradient_sum(directory, array, layout.num_params, grad_sum)
            accumulated = dict(manifest.accumulated, grad_sum=grad_sum)
            self._check_accumulated(accumulated)
        self._load_with_scaler(manifest.loss_scale,
                               lambda: self._native.load_checkpoint(directory, array),
                               "loading the checkpoint")
        del keep_alive
        self._commits.restore(manifest.step, manifest.adam_step, lags)
        self._restore_groups(manifest.param_groups)
        with self._lock:
            self._weights.from_masters()
        if accumulated is not None:
            self._resume_accumulation(accumulated)
        return directory

    # ------------------------------------------------------------------------------ both

    def _load_with_scaler(self, scaler: Tuple[float, int, int], load: Callable[[], None],
                          what: str) -> None:
        """Sets the loss scaler (every rank), then runs `load` (rank 0's); puts the scaler back
        if any rank failed."""
        opt = self._native
        with self._lock:
            opt.live()
            # The state replaces whatever the open step, or a delayed one, would have applied.
            self._commits.forget_pending()
            self._grads.abort()
            old = opt.get_scaler()
            # The scaler first: it checks its values, and is put back if the shards refuse.
            opt.set_scaler(float(scaler[0]), int(scaler[1]), int(scaler[2]))
            error = None
            if self._ranks.rank == 0:
                try:
                    load()
                except OffloadError as e:
                    error = e
                except Exception as e:  # noqa: BLE001 - every rank must learn of it
                    error = OffloadError(13, f"{type(e).__name__}: {e}")
                if error is not None:
                    opt.load_abort()
            try:
                self._ranks.agree(error, what)
            except BaseException:
                native.attempt(lambda: opt.set_scaler(*old))
                raise

    def _fixed_hyperparameters_match(self, groups: List[Dict[str, Any]],
                                     names: Optional[List[str]] = None) -> None:
        """Refuses saved groups whose number, size or fixed hyper-parameters differ: the job's
        betas, eps and weight decay are fixed on the servers when it is created. `names`: the
        groups list trained parameters by name (checkpoints), else every parameter by index."""
        mine_packed = self._layout.packed_groups(self._param_groups, names)
        if len(groups) != len(self._param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(groups, mine_packed)):
            raise ValueError("the state's parameter groups differ from this optimizer's in "
                             "number or size")
        for i, (saved, mine) in enumerate(zip(groups, self._param_groups)):
            for k in _FIXED:
                a, b = saved.get(k), mine[k]
                if k == "betas":
                    a, b = tuple(a or ()), tuple(b)
                if a != b:
                    raise ValueError(f"parameter group {i}: {k} is {saved.get(k)} in the state "
                                     f"but {mine[k]} here; the servers' job fixes it: build the "
                                     "optimizer with the saved value")

    def _restore_groups(self, groups: List[Dict[str, Any]]) -> None:
        for saved, mine in zip(groups, self._param_groups):
            for k, v in saved.items():
                if k != "params":
                    mine[k] = tuple(v) if k == "betas" else v

    # ------------------------------------------------------------------------------ mid-step

    def _accumulated(self) -> Dict[str, Any]:
        """Mid-accumulation (a step open between two backward() calls): _mid_accumulation's
        record and the fp32 sum of the step's micro-batches so far (as the servers hold it)."""
        acc = self._mid_accumulation("state_dict()")
        grad_sum = torch.empty(self._layout.num_params, dtype=torch.float32)
        try:
            self._native.read_gradient_sum(0, grad_sum)
        except BaseException:
            self._grads.abort()
            raise
        acc["grad_sum"] = grad_sum
        return acc

    def _mid_accumulation(self, what: str) -> Dict[str, Any]:
        """Saving between two backward() calls of a step: refused where a resumed run could not
        go on as this one; else every gradient handed over so far is sent, and what a resumed
        run needs besides their sum: which parameters had a gradient, how many micro-batches
        ran."""
        where = f"{what} between backward() and step()"
        grads = self._grads
        if self._ranks.world > 1:
            raise RuntimeError(f"{where} with several ranks: finish the step (each rank holds "
                               "only its partition's sum)")
        if grads.speculate_wanted:
            raise RuntimeError(f"{where} with update_in_backward=True: finish the step (the "
                               "servers hold the step's early updates until it commits)")
        if grads.done:
            raise RuntimeError(f"{where}, after clip_grad_norm_(): finish the step")
        if self._commits.pending_update:
            raise RuntimeError(f"{where} with a delayed update still to land: finish the step")
        grads.flush_all()
        return {"seen": [bool(x) for x in grads.seen], "micro_batches": grads.micro_batches}

    def _check_accumulated(self, acc: Any) -> None:
        """A state_dict's mid-accumulation entry, checked before anything is loaded."""
        num_params, n = self._layout.num_params, len(self._layout)
        ok = (isinstance(acc, dict) and isinstance(acc.get("grad_sum"), torch.Tensor)
              and acc["grad_sum"].dtype == torch.float32
              and tuple(acc["grad_sum"].shape) == (num_params,)
              and isinstance(acc.get("seen"), list) and len(acc["seen"]) == n
              and isinstance(acc.get("micro_batches"), int) and acc["micro_batches"] >= 1)
        if not ok:
            raise ValueError("the state's mid-accumulation entry is malformed: it needs grad_sum "
                             f"(float32, ({num_params},)), seen ({n} "
                             "flags) and micro_batches (>= 1)")
        if self._ranks.world > 1:
            raise ValueError("a state saved mid-accumulation resumes on one rank only")

    def _resume_accumulation(self, acc: Dict[str, Any]) -> None:
        """Opens the next step with the saved micro-batches' sum as its gradients so far: the
        next backward() adds to it, as in the run that saved it."""
        sums = torch.zeros(self._weights.part_length, dtype=torch.float32)
        sums[:self._layout.num_params] = acc["grad_sum"]
        grads = self._grads
        with self._lock:
            grads.begin_step()
            grads.speculating = False
            try:
                self._native.restore_gradient_sum(sums)
            except BaseException:
                grads.abort()
                raise
            grads.resume([bool(x) for x in acc["seen"]], acc["micro_batches"])


def checkpoint_path(path: Optional[str], what: str) -> str:
    """`path`, else a torch job's checkpoint directory (offload.job)."""
    if path is not None:
        return path
    path = _job.checkpoint_dir()
    if path is None:
        raise ValueError(f"{what}() needs a path: this process is no torch job with a "
                         "checkpoint directory (checkpoint.dir, $OFFLOAD_CHECKPOINT_DIR)")
    return path
