"""Regional compile of diffusers models: every call of every block runs compiled, in training and in
validation under no_grad, however the block's instances differ (kiln/compile/groups.py).

Depends on diffusers and Kiln's compile API; aot_eager (Dynamo traces, so graphs and eager calls
are real) on tiny random-weight models.
"""

import pytest
import torch

from kiln import compile_regions
from kiln.compile.regions import compiled_regions
from kiln.compile.report import compile_report
from toy_models import tiny_sd_unet

diffusers = pytest.importorskip("diffusers")

FAST = {"backend": "aot_eager", "dynamic": False}
UNET2D_LAYOUT = dict(sample_size=16, in_channels=3, out_channels=3, layers_per_block=2,
                     block_out_channels=(16, 32, 32, 64), norm_num_groups=8,
                     down_block_types=("DownBlock2D", "DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
                     up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D"))


def _sd_call(unet, generator):
    sample = torch.randn(2, 4, 16, 16, generator=generator)
    text = torch.randn(2, 7, 16, generator=generator)
    return unet(sample, torch.tensor([10, 700]), encoder_hidden_states=text).sample


def _unet2d_call(unet, generator):
    return unet(torch.randn(2, 3, 16, 16, generator=generator), torch.tensor([3, 400])).sample


def _train_then_validate(unet, call, steps=2):
    """Noise-prediction-like training steps, then a validation call under no_grad in eval mode."""
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        loss = call(unet, generator).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    unet.eval()
    with torch.no_grad():
        validation = call(unet, generator)
    unet.train()
    return losses, validation


def _assert_every_call_compiled(unet):
    report = compile_report(unet)
    for region in report.regions:
        assert region.eager_calls == 0 and not region.recompile_limit_hit, region
        assert region.compiled_calls == region.invocations > 0, region
    return report


@pytest.mark.long_launches
def test_sd_unet_with_resnets_as_regions_runs_every_call_compiled_and_trains_like_eager():
    eager = tiny_sd_unet()
    expected_losses, expected_validation = _train_then_validate(eager, _sd_call)
    unet = tiny_sd_unet()
    # The blocks a user picks beside the declared one: ResnetBlock2D's 22 instances come in 12
    # shapes, more than Dynamo's 8 graphs for one entry.
    compile_regions(unet, block_classes=["ResnetBlock2D", "BasicTransformerBlock"], **FAST)
    losses, validation = _train_then_validate(unet, _sd_call)
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    torch.testing.assert_close(validation, expected_validation, rtol=1e-4, atol=1e-5)
    report = _assert_every_call_compiled(unet)
    resnets = [r for r in report.regions if r.block_class == "ResnetBlock2D"]
    assert sum(r.instances for r in resnets) == 22 and len(resnets) == 12
    # One compile per group and what the data varies (train, no_grad, input layout): each group's
    # entry stays far from the limit, and the whole class from one graph per instance and mode.
    assert max(r.graphs for r in resnets) < 8, [r.graphs for r in resnets]
    assert "ResnetBlock2D: 12 groups of instances whose graphs differ" in report.table()


def test_sd_unet_compiles_the_blocks_it_declares_and_runs_them_compiled():
    unet = tiny_sd_unet()
    compile_regions(unet, **FAST)
    _train_then_validate(unet, _sd_call)
    report = _assert_every_call_compiled(unet)
    assert {r.block_class for r in report.regions} == {"BasicTransformerBlock"}
    assert report.regions[0].chosen_by == "the model's _repeated_blocks (BasicTransformerBlock)"
    # Three widths of transformer blocks: a group each, 16 instances in all.
    assert [r.instances for r in report.regions] == [5, 5, 6]


def test_unet2d_regions_are_its_resnets_and_attentions_all_run_compiled():
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(**UNET2D_LAYOUT)
    compile_regions(unet, **FAST)
    _train_then_validate(unet, _unet2d_call)
    report = _assert_every_call_compiled(unet)
    # Not the down/up stages (each of its own width: no code to share), but the blocks inside them.
    assert {r.block_class for r in report.regions} == {"ResnetBlock2D", "Attention"}
    assert report.regions[0].chosen_by == "found: repeated in a container"


def test_flux_transformer_blocks_stay_one_group_per_class():
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=2, num_single_layers=3, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))
    compile_regions(model, **FAST)

    def call(m, generator):
        return m(hidden_states=torch.randn(1, 16, 8, generator=generator),
                 encoder_hidden_states=torch.randn(1, 5, 32, generator=generator),
                 pooled_projections=torch.randn(1, 32, generator=generator), timestep=torch.tensor([0.5]),
                 img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(5, 3)).sample

    _train_then_validate(model, call)
    _assert_every_call_compiled(model)
    regions = compiled_regions(model)
    assert [(r.name, r.instances) for r in regions] == [("FluxTransformerBlock", 2),
                                                        ("FluxSingleTransformerBlock", 3)]
    # Training: one graph for the double-stream blocks; validation adds the no_grad graph.
    assert regions[0].graphs == 2
