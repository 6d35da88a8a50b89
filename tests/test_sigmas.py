"""Sigma ladders vs the diffusers 0.42.1 schedulers and pipelines, and the reference check values.

Every ladder is compared bit for bit (``assert_array_equal``): digen-jax mirrors diffusers'
float32/float64 rounding so that rollouts line up with torch references exactly.
"""
import numpy as np
import pytest

from digen_jax.diffusion import (
    LADDER_FAMILIES,
    calculate_shift,
    dancegrpo_ladder,
    flux_ladder,
    hunyuan_video_ladder,
    packed_seq_len,
    qwen_image_ladder,
    sd3_ladder,
    sigma_ladder,
    wan_unipc_ladder,
)

# (height, width) in pixels: square sizes plus the non-square 1328x1024.
RESOLUTIONS = [(256, 256), (512, 512), (1024, 1024), (1328, 1024)]

# Scheduler configs from docs/models.md section 5 (FLUX.1-dev and Qwen-Image scheduler_config.json).
FLUX_CONFIG = dict(
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)
QWEN_CONFIG = dict(
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=0.9,
    base_image_seq_len=256,
    max_image_seq_len=8192,
    shift_terminal=0.02,
    time_shift_type="exponential",
)


@pytest.fixture(scope="module")
def flow_match_euler():
    module = pytest.importorskip("diffusers.schedulers.scheduling_flow_match_euler_discrete")
    return module.FlowMatchEulerDiscreteScheduler


def _pipeline_shift(module_name):
    return pytest.importorskip(module_name).calculate_shift


def _assert_same_ladder(ladder, scheduler):
    np.testing.assert_array_equal(ladder.sigmas, scheduler.sigmas.numpy())
    np.testing.assert_array_equal(ladder.timesteps, scheduler.timesteps.numpy())
    assert ladder.sigmas.dtype == np.float32
    assert ladder.sigmas[-1] == 0.0
    assert ladder.num_steps == len(ladder.timesteps)


def test_calculate_shift_matches_pipelines_and_models_md():
    """mu of diffusers pipelines/flux/pipeline_flux.py and pipelines/qwenimage/pipeline_qwenimage.py
    (both ``calculate_shift``), and the mu values listed in docs/models.md section 5."""
    flux_shift = _pipeline_shift("diffusers.pipelines.flux.pipeline_flux")
    qwen_shift = _pipeline_shift("diffusers.pipelines.qwenimage.pipeline_qwenimage")
    for height, width in RESOLUTIONS + [(1328, 1328), (720, 720)]:
        seq = packed_seq_len(height, width)
        assert calculate_shift(seq) == flux_shift(seq, 256, 4096, 0.5, 1.15)
        assert calculate_shift(seq, 256, 8192, 0.5, 0.9) == qwen_shift(seq, 256, 8192, 0.5, 0.9)
    assert flux_ladder(6, packed_seq_len(512, 512)).mu == pytest.approx(0.630, abs=5e-4)
    assert flux_ladder(6, packed_seq_len(1024, 1024)).mu == pytest.approx(1.15, abs=5e-4)
    for size, mu in [(512, 0.539), (1024, 0.694), (1328, 0.834)]:
        assert qwen_image_ladder(6, packed_seq_len(size, size)).mu == pytest.approx(mu, abs=5e-4)


@pytest.mark.parametrize("num_steps", [1, 6, 10, 28])
@pytest.mark.parametrize("height,width", RESOLUTIONS)
def test_flux_ladder_matches_diffusers(flow_match_euler, height, width, num_steps):
    """FluxPipeline.__call__ (diffusers pipelines/flux/pipeline_flux.py) passes
    sigmas = linspace(1, 1/N, N) and mu = calculate_shift(packed tokens) to the scheduler."""
    flux_shift = _pipeline_shift("diffusers.pipelines.flux.pipeline_flux")
    seq = packed_seq_len(height, width)
    scheduler = flow_match_euler(**FLUX_CONFIG)
    scheduler.set_timesteps(
        sigmas=np.linspace(1.0, 1 / num_steps, num_steps),
        mu=flux_shift(seq, 256, 4096, 0.5, 1.15),
    )
    _assert_same_ladder(flux_ladder(num_steps, seq), scheduler)


@pytest.mark.parametrize("num_steps", [2, 6, 10, 28])
@pytest.mark.parametrize("height,width", RESOLUTIONS + [(1328, 1328)])
def test_qwen_image_ladder_matches_diffusers(flow_match_euler, height, width, num_steps):
    """QwenImagePipeline.__call__ (diffusers pipelines/qwenimage/pipeline_qwenimage.py): same
    sigmas as FLUX, mu from seq 256..8192 / shift 0.5..0.9, then shift_terminal=0.02."""
    qwen_shift = _pipeline_shift("diffusers.pipelines.qwenimage.pipeline_qwenimage")
    seq = packed_seq_len(height, width)
    scheduler = flow_match_euler(**QWEN_CONFIG)
    scheduler.set_timesteps(
        sigmas=np.linspace(1.0, 1 / num_steps, num_steps),
        mu=qwen_shift(seq, 256, 8192, 0.5, 0.9),
    )
    ladder = qwen_image_ladder(num_steps, seq)
    _assert_same_ladder(ladder, scheduler)
    assert ladder.sigmas[-2] == pytest.approx(0.02, abs=1e-6)


def test_qwen_image_single_step_raises_instead_of_nan():
    """diffusers' stretch_shift_to_terminal divides 0 by 0 for a one-step ladder (NaN sigmas)."""
    with pytest.raises(ValueError, match="num_steps >= 2"):
        qwen_image_ladder(1, 4096)


def test_reference_example_ladders():
    """docs/algorithms.md A6 (flow_grpo flow_grpo/diffusers_patch/flux_pipeline_with_logprob.py):
    FLUX 512 px, N = 6; docs/models.md section 5: Qwen-Image 1024 px, N = 10."""
    flux = flux_ladder(6, packed_seq_len(512, 512)).sigmas
    np.testing.assert_allclose(flux, [1, 0.9037, 0.7897, 0.6525, 0.4842, 0.2730, 0], atol=5e-5)
    qwen = qwen_image_ladder(10, packed_seq_len(1024, 1024)).sigmas
    expected = [1, 0.937, 0.867, 0.789, 0.701, 0.601, 0.487, 0.355, 0.202, 0.02, 0]
    np.testing.assert_allclose(qwen, expected, atol=5e-4)


@pytest.mark.parametrize("num_steps", [1, 6, 10, 28, 50])
def test_sd3_ladder_matches_diffusers(flow_match_euler, num_steps):
    """FlowMatchEulerDiscreteScheduler(shift=3.0).set_timesteps(N), the SD3.5 pipeline's call
    (diffusers schedulers/scheduling_flow_match_euler_discrete.py)."""
    scheduler = flow_match_euler(shift=3.0)
    scheduler.set_timesteps(num_steps)
    _assert_same_ladder(sd3_ladder(num_steps), scheduler)


def test_sd3_ladder_check_values():
    """docs/algorithms.md A1 check values (flow_grpo flow_grpo/diffusers_patch/sd3_sde_with_logprob.py
    on SD3.5-M, shift 3, N = 10). The 0.0089 end point is diffusers' double shift."""
    expected = [1, 0.9601, 0.9133, 0.8577, 0.7904, 0.7073, 0.6022, 0.4649, 0.2780, 0.0089, 0]
    np.testing.assert_allclose(sd3_ladder(10).sigmas, expected, atol=5e-5)


@pytest.mark.parametrize("num_steps", [1, 6, 16, 50])
def test_hunyuan_video_ladder_matches_diffusers(flow_match_euler, num_steps):
    """HunyuanVideoPipeline.__call__ (diffusers pipelines/hunyuan_video/pipeline_hunyuan_video.py)
    passes sigmas = linspace(1, 0, N + 1)[:-1] to FlowMatchEuler with the static shift 7."""
    scheduler = flow_match_euler(shift=7.0)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1])
    _assert_same_ladder(hunyuan_video_ladder(num_steps), scheduler)


@pytest.mark.parametrize("num_steps", [1, 10, 20, 50])
def test_wan_ladder_matches_unipc(num_steps):
    """UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
    flow_shift=3.0) (diffusers schedulers/scheduling_unipc_multistep.py), the Wan2.1 scheduler
    flow_grpo flow_grpo/diffusers_patch/wan_pipeline_with_logprob.py reads sigmas from."""
    module = pytest.importorskip("diffusers.schedulers.scheduling_unipc_multistep")
    scheduler = module.UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    scheduler.set_timesteps(num_steps)
    ladder = wan_unipc_ladder(num_steps)
    _assert_same_ladder(ladder, scheduler)
    assert ladder.timesteps.dtype == np.int64
    # UniPC quirk: the ladder starts just below 1, and the first integer timestep is 999.
    assert ladder.sigmas[0] == np.float32(1 - 1e-6)
    assert ladder.timesteps[0] == 999


def test_wan_sigma_1_check_value():
    """docs/algorithms.md A3: for N = 20 the Wan UniPC ladder has sigma_1 = .9828."""
    assert wan_unipc_ladder(20).sigmas[1] == pytest.approx(0.9828, abs=5e-5)


@pytest.mark.parametrize("shift", [3.0, 5.0])
@pytest.mark.parametrize("num_steps", [7, 12, 16, 20, 25])
def test_dancegrpo_ladder_matches_reference(num_steps, shift):
    """DanceGRPO fastvideo/train_grpo_flux.py: sigma_schedule = sd3_time_shift(shift,
    torch.linspace(1, 0, N + 1)) and timestep = int(sigma * 1000), restated in torch."""
    torch = pytest.importorskip("torch")
    t = torch.linspace(1, 0, num_steps + 1)
    sigmas = (shift * t) / (1 + (shift - 1) * t)
    ladder = dancegrpo_ladder(num_steps, shift=shift)
    np.testing.assert_array_equal(ladder.sigmas, sigmas.numpy())
    np.testing.assert_array_equal(ladder.timesteps, [int(s * 1000) for s in sigmas[:-1]])


def test_dispatcher_matches_family_functions():
    seq = packed_seq_len(512, 512)
    pairs = [
        (sigma_ladder("flux", 6, seq), flux_ladder(6, seq)),
        (sigma_ladder("qwen_image", 10, seq), qwen_image_ladder(10, seq)),
        (sigma_ladder("sd3", 10), sd3_ladder(10)),
        (sigma_ladder("hunyuan_video", 16, shift=5.0), hunyuan_video_ladder(16, shift=5.0)),
        (sigma_ladder("wan", 20, image_seq_len=seq), wan_unipc_ladder(20)),
        (sigma_ladder("dancegrpo", 16), dancegrpo_ladder(16)),
    ]
    for got, want in pairs:
        np.testing.assert_array_equal(got.sigmas, want.sigmas)
        np.testing.assert_array_equal(got.timesteps, want.timesteps)
    assert set(LADDER_FAMILIES) == {
        "flux", "qwen_image", "sd3", "hunyuan_video", "wan", "dancegrpo"
    }


def test_dispatcher_and_ladders_validate_input():
    with pytest.raises(ValueError, match="valid families: flux, qwen_image, sd3"):
        sigma_ladder("sdxl", 10)
    with pytest.raises(ValueError, match="pass image_seq_len"):
        sigma_ladder("flux", 6)
    with pytest.raises(ValueError, match="image_seq_len must be > 0"):
        sigma_ladder("qwen_image", 6, image_seq_len=0)
    with pytest.raises(ValueError, match="unknown override"):
        sigma_ladder("sd3", 10, flow_shift=3.0)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="num_steps"):
            sigma_ladder("sd3", bad)
    with pytest.raises(ValueError, match="shift must be > 0"):
        hunyuan_video_ladder(10, shift=0.0)
