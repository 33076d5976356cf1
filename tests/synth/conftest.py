"""Synthesis fixtures: a tiny diffusers inpainting pipeline and a tiny segmentation model built from configs
(random weights, saved to a temporary directory), and an in-process synthesis server."""

import contextlib
import json

import numpy as np
import pytest

from vlrl.serving import ServerThread
from vlrl.synth.app import create_app
from vlrl.synth.schema import SynthSettings
from vlrl.synth.server import SynthService

API_KEY = "synth-test-key"


@pytest.fixture(autouse=True)
def _single_threaded(one_thread):
    """Server threads and the test share 2 cores: every synth test runs torch single-threaded."""
    yield


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP byte → printable character table (what a byte-level BPE vocabulary is written in)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = keep[:], 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(keep, [chr(c) for c in codes], strict=True))


@pytest.fixture(scope="session")
def tiny_inpaint_dir(tmp_path_factory):
    """A ~50k-parameter Stable Diffusion inpainting pipeline (UNet with 9 input channels, a 2-block VAE, a
    1-layer CLIP text encoder, a byte-level CLIP tokenizer without merges), saved with save_pretrained."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionInpaintPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    root = tmp_path_factory.mktemp("tiny-inpaint")
    chars = list(_bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    vocab.update({"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1})
    (root / "vocab.json").write_text(json.dumps(vocab))
    (root / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(root / "vocab.json"), str(root / "merges.txt"), model_max_length=16)
    torch.manual_seed(0)
    unet = UNet2DConditionModel(sample_size=8, in_channels=9, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
                                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=16,
                                attention_head_dim=2, norm_num_groups=4)
    vae = AutoencoderKL(down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                        block_out_channels=[8, 16], latent_channels=4, norm_num_groups=4, layers_per_block=1)
    text = CLIPTextModel(CLIPTextConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, max_position_embeddings=16,
                                        bos_token_id=vocab["<|startoftext|>"], eos_token_id=vocab["<|endoftext|>"],
                                        pad_token_id=vocab["<|endoftext|>"]))
    pipeline = StableDiffusionInpaintPipeline(vae=vae, text_encoder=text, tokenizer=tokenizer, unet=unet,
                                              scheduler=DDIMScheduler(steps_offset=1), safety_checker=None, feature_extractor=None,
                                              requires_safety_checker=False)
    pipeline.save_pretrained(root / "pipeline")
    return str(root / "pipeline")


@pytest.fixture(scope="session")
def tiny_segformer_dir(tmp_path_factory):
    """A tiny 2-class SegFormer and its (PIL) image processor, saved with save_pretrained."""
    import torch
    from transformers import SegformerConfig, SegformerForSemanticSegmentation
    from transformers.models.segformer.image_processing_pil_segformer import SegformerImageProcessorPil

    root = tmp_path_factory.mktemp("tiny-segformer")
    torch.manual_seed(0)
    config = SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
                             patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 1], mlp_ratios=[2, 2],
                             decoder_hidden_size=16, num_labels=2)
    SegformerForSemanticSegmentation(config).save_pretrained(root)
    SegformerImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(root)
    return str(root)


@contextlib.contextmanager
def synth_server(api_key=API_KEY, **settings):
    """A synthesis service (thread executor unless told) behind the HTTP app, on a free loopback port."""
    service = SynthService(SynthSettings(**{"executor": "thread", **settings}))
    server = ServerThread(create_app(service, api_key=api_key))
    try:
        yield server.url, service
    finally:
        server.stop()
        service.close()


def shapes_scene(seed: int = 0):
    """A shapes image (H, W, 3) uint8 and the boxes of its objects."""
    from vlrl.data import generate

    sample = generate("shapes", 1, tasks=["locate"], seed=seed, max_shapes=4)[0]
    return np.asarray(sample.images[0].convert("RGB")), [o["box"] for o in sample.metadata["objects"]]
