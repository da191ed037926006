"""Model config parsing: HF and original flavours, padding, refusal of non-Mamba-1 configs by field."""

import pytest

from mambatrt.config import MambaConfig, parse_config
from mambatrt.errors import ConfigError

HF_130M = {
    "model_type": "mamba",
    "hidden_size": 768,
    "num_hidden_layers": 24,
    "intermediate_size": 1536,
    "state_size": 16,
    "conv_kernel": 4,
    "expand": 2,
    "time_step_rank": 48,
    "vocab_size": 50280,
    "layer_norm_epsilon": 1e-5,
    "use_bias": False,
    "use_conv_bias": True,
    "tie_word_embeddings": True,
}
ORIGINAL_130M = {
    "d_model": 768,
    "n_layer": 24,
    "vocab_size": 50277,
    "ssm_cfg": {},
    "rms_norm": True,
    "residual_in_fp32": True,
    "fused_add_norm": True,
    "pad_vocab_size_multiple": 8,
}


def test_hf_and_original_agree():
    hf = parse_config(HF_130M)
    orig = parse_config(ORIGINAL_130M)
    assert (hf.d_inner, hf.dt_rank, hf.vocab_padded) == (1536, 48, 50280)
    assert (orig.d_inner, orig.dt_rank, orig.vocab_size, orig.vocab_padded) == (1536, 48, 50277, 50280)
    assert hf.conv_state_shape == orig.conv_state_shape == (24, 1536, 3)
    assert hf.ssm_state_shape == (24, 1536, 16)


def test_frozen_and_round_trip():
    cfg = parse_config(HF_130M)
    with pytest.raises(AttributeError):
        cfg.d_model = 1
    assert MambaConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "raw, message",
    [
        ({**HF_130M, "model_type": "mamba2"}, "model_type 'mamba2' is not supported"),
        ({k: v for k, v in HF_130M.items() if k != "state_size"}, "missing field 'state_size'"),
        ({k: v for k, v in ORIGINAL_130M.items() if k != "n_layer"}, "missing field 'n_layer'"),
        ({**ORIGINAL_130M, "ssm_cfg": {"layer": "Mamba2"}}, "ssm_cfg.layer 'Mamba2' is not supported"),
        ({**ORIGINAL_130M, "rms_norm": False}, "rms_norm=false"),
        ({"model_type": "llama"}, "model_type 'llama' is not supported"),
        ({"hidden_size": 3}, "neither 'model_type'"),
        ({**HF_130M, "state_size": 0}, "'d_state' must be a positive integer"),
    ],
)
def test_unsupported_configs_name_the_field(raw, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)
