"""Instance groups (kiln/compile/groups.py): a block class whose instances differ in what their
graphs depend on gets one compiled entry per group, so no call runs eagerly for lack of Dynamo's
recompile budget, and identical instances still share one graph."""

import warnings

import pytest
import torch
from torch import nn

from kiln import compile_regions, find_repeated_blocks
from kiln.compile.groups import group_instances, instance_features
from kiln.compile.regions import compiled_regions
from kiln.compile.report import compile_report
from torch_features import saves_ahead_of_time

FAST = {"backend": "aot_eager", "fullgraph": True, "dynamic": False}


class Resnetish(nn.Module):
    """A block whose instances differ as a UNet's do: widths, an optional shortcut, a flag."""

    def __init__(self, width_in: int, width_out: int, up: bool = False, index: int = 0):
        super().__init__()
        self.norm = nn.LayerNorm(width_in)
        self.fc = nn.Linear(width_in, width_out)
        self.shortcut = nn.Linear(width_in, width_out) if width_in != width_out else None
        self.up = up
        self.index = index  # differs on every instance and is never read: no group of its own

    def forward(self, x):
        h = torch.nn.functional.gelu(self.fc(self.norm(x)))
        skip = x if self.shortcut is None else self.shortcut(x)
        out = h + skip
        return out * 2 if self.up else out


class Ladder(nn.Module):
    """Twelve blocks over ten distinct (width, flag) pairs: more than Dynamo's 8 graphs per entry."""

    PAIRS = [(8, 8), (8, 8), (8, 12), (12, 16), (16, 16), (16, 16), (16, 20), (20, 24), (24, 28), (28, 32),
             (32, 40), (40, 40)]

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        pairs = self.PAIRS
        self.blocks = nn.ModuleList(Resnetish(a, b, up=i == 11, index=i) for i, (a, b) in enumerate(pairs))
        self.head = nn.Linear(40, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x).squeeze(-1)


def _train(model, steps=3, seed=0):
    torch.manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        loss = (model(torch.randn(6, 4)) - 1).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_groups_follow_parameter_shapes_submodules_and_flags_not_indices():
    blocks = [Resnetish(8, 8, index=0), Resnetish(8, 8, index=1), Resnetish(8, 16), Resnetish(8, 8, up=True)]
    groups = group_instances(blocks, ["a", "b", "c", "d"])
    assert [g.paths for g in groups] == [["a", "b"], ["c"], ["d"]]
    features = instance_features(blocks[2])
    assert features["fc.weight"] == ((16, 8), "torch.float32", True)
    assert features["shortcut"] == "Linear" and instance_features(blocks[0])["shortcut"] is None
    assert "index" not in features and "training" not in features


def test_a_class_with_more_distinct_instances_than_the_recompile_limit_runs_every_call_compiled():
    torch.manual_seed(0)
    model = Ladder()
    eager = Ladder()
    eager.load_state_dict(model.state_dict())
    compile_regions(model, block_classes=[Resnetish], **FAST)
    losses = _train(model)
    assert losses == _train(eager)
    regions = compiled_regions(model)
    assert len(regions) == 10  # (8->8) x2 and (16->16) share; the last one's flag sets it apart
    assert [r.name for r in regions][:2] == ["Resnetish#1", "Resnetish#2"]
    assert sum(r.instances for r in regions) == 12
    assert all(r.eager_calls == 0 and not r.recompile_limit_hit for r in regions)
    assert sum(r.calls for r in regions) == 12 * 3
    # One compile per distinct group: each group's entry traced one graph for its 3 training steps.
    assert [r.graphs for r in regions] == [1] * 10
    report = compile_report(model)
    assert report.regions[0].group == (1, 10) and report.regions[0].paths == ["blocks.0", "blocks.1"]
    table = report.table()
    assert "Resnetish: 10 groups of instances whose graphs differ" in table
    assert "Resnetish#10: 1 instance(s) (blocks.11); unlike #1: up True" in table


def test_validation_under_no_grad_adds_one_graph_per_group_and_no_eager_call():
    torch.manual_seed(0)
    model = Ladder()
    compile_regions(model, block_classes=[Resnetish], **FAST)
    _train(model, steps=2)
    model.eval()
    with torch.no_grad():
        model(torch.randn(6, 4))
    regions = compiled_regions(model)
    assert all(r.eager_calls == 0 for r in regions)
    assert [r.graphs for r in regions] == [2] * 10


def test_identical_instances_stay_one_region_named_by_their_class():
    model = nn.Sequential(*(Resnetish(8, 8, index=i) for i in range(4)))
    compile_regions(model, **FAST)
    regions = compiled_regions(model)
    assert [(r.name, r.instances, r.group) for r in regions] == [("Resnetish", 4, (1, 1))]
    with torch.no_grad():
        model(torch.randn(2, 8))
    assert regions[0].graphs == 1


def test_search_looks_inside_repeated_stages_that_share_nothing():
    class Stage(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.blocks = nn.ModuleList(Resnetish(width, width) for _ in range(2))

    # Each stage has its own width: a region per stage would compile each once anyway.
    model = nn.ModuleList([Stage(8), Stage(16), Stage(32)])
    assert find_repeated_blocks(model) == {Resnetish: [f"{s}.blocks.{b}" for s in range(3) for b in range(2)]}
    # Stages that repeat exactly stay the regions.
    model = nn.ModuleList([Stage(8), Stage(8)])
    assert find_repeated_blocks(model) == {Stage: ["0", "1"]}


class SwappedLinear(nn.Linear):
    """A linear of its own class holding the same tensors, as torchao's float8 swap leaves one."""

    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias)


def test_blocks_that_differ_only_in_a_swapped_submodule_class_are_still_block_regions():
    # The float8 swap leaves a model's first linear plain: layer 0 then differs from every other layer
    # in one submodule's class alone, and with two layers no two are alike. They are still the blocks.
    torch.manual_seed(0)
    model = nn.Sequential(*(Resnetish(8, 8, index=i) for i in range(2)))
    eager = nn.Sequential(*(Resnetish(8, 8) for _ in range(2)))
    eager.load_state_dict(model.state_dict())
    swapped = SwappedLinear(8, 8)
    swapped.load_state_dict(model[0].fc.state_dict())
    model[0].fc = swapped
    assert find_repeated_blocks(model) == {Resnetish: ["0", "1"]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no repeated blocks, compiling the whole model" warning
        compile_regions(model, **FAST)
    regions = compiled_regions(model)
    assert [(r.name, r.paths) for r in regions] == [("Resnetish#1", ["0"]), ("Resnetish#2", ["1"])]
    assert "Resnetish#2: 1 instance(s) (1); unlike #1: fc 'Linear'" in compile_report(model).table()
    x = torch.randn(2, 8)
    assert torch.equal(model(x), eager(x))
    assert all(r.calls == 1 and r.eager_calls == 0 for r in regions)
    # Instances whose tensors differ (another width) are not repeats: the search looks inside them.
    assert find_repeated_blocks(nn.Sequential(Resnetish(8, 8), Resnetish(8, 16))) == {}


def test_each_group_is_precompiled_apart_and_a_later_run_loads_it(tmp_path):
    if not saves_ahead_of_time("aot_eager"):
        pytest.skip(f"torch {torch.__version__} saves Inductor output only; groups do not depend on the backend")

    def build():
        torch.manual_seed(0)
        return compile_regions(nn.Sequential(Resnetish(8, 8), Resnetish(8, 8), Resnetish(8, 16)),
                               precompile=tmp_path, backend="aot_eager", fullgraph=True)

    x = torch.randn(2, 8)
    first = build()
    with torch.no_grad():
        expected = first(x)
    assert [r.name for r in compiled_regions(first)] == ["Resnetish#1", "Resnetish#2"]
    torch._dynamo.reset()  # a later run: nothing compiled in memory is reused
    later = build()
    with torch.no_grad():
        torch.testing.assert_close(later(x), expected)
    # Each group found its own artifact (one signature each) and ran it with no Dynamo trace.
    assert [(r.precompiled_loaded, r.traces, r.precompiled_calls, r.eager_calls)
            for r in compile_report(later).regions] == [(1, 0, 2, 0), (1, 0, 1, 0)]
