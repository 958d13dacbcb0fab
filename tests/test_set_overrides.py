"""One ``--set`` parser (`moe_core.configfile.apply_override`) for the library's configs and the flows'
parameters: the same item gets the same answer from both, naming the item and the closest field."""

from __future__ import annotations

import pytest

from flows.params import FlowParamsError, LifecycleParams
from moe_core.configfile import apply_override
from moe_core.finetune.config import FinetuneConfig, FinetuneError
from moe_core.train.config import TrainConfig, TrainConfigError


def flow_set(*items: str, **train) -> dict:
    data = {"train": TrainConfig(**train).model_dump(mode="json")}
    for item in items:
        apply_override(data, item, LifecycleParams, error_cls=FlowParamsError)
    return data


MISTAKES = [  # (item, what the error says), for `moe-lab train --set` and `moe-lab run lifecycle --set train.…`
    ("optm.lr=1", "unknown field '{p}optm'; did you mean 'optim'?"),
    ("optim.lrr=1", "unknown field '{p}optim.lrr'; did you mean 'lr'?"),
    ("steps.x=1", "{p}steps is a value (50), not a section, so {p}steps.x cannot be set"),
    ("optim..lr=1", "expected key=value with a dotted key, e.g. "),
    ("optim.betas=[0.9,", "the value is not valid YAML"),
]


@pytest.mark.parametrize("item, message", MISTAKES)
def test_the_library_and_the_flows_answer_an_item_alike(item, message):
    with pytest.raises(TrainConfigError) as library:
        TrainConfig().with_overrides([item])
    assert f"--set '{item}': " + message.format(p="") in str(library.value)
    with pytest.raises(FlowParamsError) as flows:
        flow_set(f"train.{item}", steps=50)
    assert f"--set 'train.{item}': " + message.format(p="train.") in str(flows.value)


def test_an_item_without_a_key_shows_a_key_of_that_config():
    with pytest.raises(TrainConfigError, match="e.g. model.preset=VALUE"):
        TrainConfig().with_overrides(["steps"])
    with pytest.raises(FlowParamsError, match="e.g. train.model.preset=VALUE"):
        flow_set("=3")


def test_sections_are_walked_through_their_classes():
    data = flow_set(
        "train.steps=7",
        "optimize.onnx=false",  # an optional section (OptimizeParams | None), created when absent
        "validation.min_chars=3",  # a dataclass section
        "train.model.overrides.num_experts=4",  # a dict-typed field: its keys are data
    )
    params = LifecycleParams.model_validate(data)
    assert params.train.steps == 7 and params.optimize.onnx is False
    assert params.validation.min_chars == 3 and params.train.model.overrides == {"num_experts": 4}
    with pytest.raises(
        FlowParamsError, match="unknown field 'validation.min_charz'; did you mean 'min_chars'"
    ):
        flow_set("validation.min_charz=3")
    with pytest.raises(FlowParamsError, match="did you mean 'train'"):
        flow_set("trian.steps=3")
    off = {"optimize": None}  # a section turned off in a params file is a value, not written through
    with pytest.raises(FlowParamsError, match=r"optimize is a value \(None\), not a section"):
        apply_override(off, "optimize.onnx=false", LifecycleParams, error_cls=FlowParamsError)


def test_dict_fields_take_new_keys_and_their_config_checks_them():
    config = TrainConfig().with_overrides(["model.overrides.num_experts=4"])
    assert config.model.overrides == {"num_experts": 4}
    with pytest.raises(TrainConfigError, match="did you mean 'num_experts'"):
        TrainConfig().with_overrides(["model.overrides.num_expert=4"])  # MoEConfig's own check
    tuned = FinetuneConfig().with_overrides(["lora.experts=list", "lora.expert_ids.1=[0, 2]"])
    assert tuned.lora.expert_ids == {1: [0, 2]}
    with pytest.raises(FinetuneError, match="unknown field 'lora.expert_id'; did you mean 'expert_ids'"):
        FinetuneConfig().with_overrides(["lora.expert_id=[1]"])
