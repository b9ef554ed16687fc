"""The registry tests leave nothing out silently: every entry of the installed transformers' conversion
registry is a case that builds (test_shard_<k>.py), or lives in a package whose cases do, or is listed
with its reason; every op the registry uses is run by a case that builds; and every listed reason holds."""

from __future__ import annotations

import re

import pytest

from tests.fidelity.registry import cases as registry
from tests.fidelity.registry.check import build

# Registry keys that name no class or model type of the installed transformers: nothing can match them.
_NOWHERE = "no class or model type of this name in transformers"


def _package(key: str) -> str | None:
    """The package of a registry key: its model type's, its class's model type's, or the one defining it."""
    if key in registry.model_types():
        return registry.package_of_type(key)
    mt = registry.model_type_of_class(key)
    return registry.package_of_type(mt) if mt is not None else registry.class_packages().get(key)


def _coverage() -> tuple[dict[str, list[str]], dict[str, str]]:
    """Package -> the ids of its cases that build; key -> why no built case covers it, for the rest."""
    built: dict[str, list[str]] = {}
    for c in registry.cases():
        if c.id not in registry.UNBUILDABLE:
            built.setdefault(registry.package_of_type(c.model_type), []).append(c.id)
    missing: dict[str, str] = {}
    for key in registry.registry():
        if key == "legacy":  # transformers adds it to every model's conversions
            continue
        pkg = _package(key)
        if pkg is None:
            missing[key] = _NOWHERE
        elif pkg not in built:
            listed = [c.id for c in registry.cases() if registry.package_of_type(c.model_type) == pkg]
            reasons = {registry.UNBUILDABLE[i][1] for i in listed if i in registry.UNBUILDABLE}
            missing[key] = f"its cases {listed} do not build: {sorted(reasons)}" if listed else "no case"
    return built, missing


def test_every_registry_entry_is_a_built_case_or_says_why_not():
    _, missing = _coverage()
    uncovered = {k: why for k, why in missing.items() if why == "no case" or "[]" in why}
    assert not uncovered, f"registry entries no case runs, and no reason: {uncovered}"
    for key, why in missing.items():
        if why == _NOWHERE:  # truly nothing by that name: not a model type, no class in any package
            assert key not in registry.model_types() and key not in registry.class_packages(), key


def test_every_registry_op_is_run_by_a_case_that_builds():
    """A ConversionOps class the installed registry uses, that no case which builds runs, is named here:
    a new op is either planned (its cases pass) or this fails with its name."""
    _, missing = _coverage()
    run: set[str] = set()
    unrun: dict[str, set[str]] = {}
    for key, transforms in registry.registry().items():
        ops = {type(op).__name__ for t in transforms for op in getattr(t, "operations", [])}
        if key in missing:
            for op in ops:
                unrun.setdefault(op, set()).add(key)
        else:
            run |= ops
    never = {op: sorted(keys) for op, keys in unrun.items() if op not in run}
    assert not never, f"registry ops no built case runs (op: its entries): {never}"


@pytest.mark.parametrize(
    "case", [c for c in registry.cases() if c.id in registry.UNBUILDABLE], ids=lambda c: c.id
)  # a listed case this transformers lacks is no error
def test_each_listed_case_still_cannot_be_built(case):
    """The reason given holds on the installed transformers."""
    raises, why = registry.UNBUILDABLE[case.id]
    with pytest.raises(Exception) as raised:
        build(case)
    got = f"{type(raised.value).__name__}: {raised.value}"
    assert re.match(raises, got, re.S), (case.id, why, got)


def test_llava_and_qwen2_vl_are_cases_with_their_vision_towers():
    """The image-text models the README names run like any other case, vision tower included."""
    ids = {c.id for s in range(registry.SHARDS) for c in registry.params(s)}
    assert {"llava", "qwen2_vl"} <= ids
    for mt in ("llava", "qwen2_vl"):
        case = next(c for c in registry.cases() if c.id == mt)
        names = list(build(case).state_dict())
        assert any(re.search(r"vision_tower|visual", n) for n in names), (mt, names[:5])


def test_an_op_that_cannot_be_planned_fails_its_case_with_the_ops_name(tmp_path):
    """A registry op whose save-time conversion is no byte move (here a flip of the rows) fails the case
    with the op's class named, not at a user's save mid-run."""
    from transformers.core_model_loading import ConversionOps, WeightConverter

    from stagerd import Stager
    from tests.fidelity.registry.check import check

    class FlipRows(ConversionOps):
        def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
            (tensor,) = (v[0] if isinstance(v, list) else v for v in input_dict.values())
            return {target_patterns[0]: tensor.flip(0)}

        @property
        def reverse_op(self):
            return FlipRows()

    case = next(c for c in registry.cases() if c.id == "llama-tied")
    model = build(case)
    model._weight_conversions = [
        WeightConverter("mlp.down_flipped", "mlp.down_proj.weight", operations=[FlipRows()])
    ]
    with (
        Stager(tmp_path / "root", checkpointer="thread") as stager,
        pytest.raises(AssertionError, match=r"uses 'flip'.*registry ops: FlipRows"),
    ):
        check(case, stager, 1, tmp_path, model=model)
