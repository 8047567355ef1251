"""An actor on a host without the model directory rebuilds it from what the driver ships (config,
tokenizer, prompts) and the weights the learner's weight server publishes: the same model, the same
tokenizer, the same prompts, at the published version."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dph_async.actors.weight_client import WeightClient
from dph_async.config import ModelConfig
from dph_async.learner.publish import WeightServer
from dph_async.net import NetSecurity
from dph_async.runtime.model_shipping import first_weights, materialize, pack
from dph_async.tasks.dataset import load_prompts, verl_row, write_rows
from dph_async.tasks.embedded import ALPHABET
from dph_async.tasks.tiny_model import build_tiny_llama, build_tokenizer, save_model


@pytest.fixture
def head_files(tmp_path: Path) -> tuple[Path, Path, torch.nn.Module]:
    tok = build_tokenizer(ALPHABET)
    model = build_tiny_llama(ModelConfig(), len(tok), seed=3)
    model_dir = save_model(model, tok, tmp_path / "head" / "model")
    prompts = write_rows([verl_row(f"{i}+{i}=", "embedded", str(2 * i), i, "train") for i in range(5)],
                         tmp_path / "head" / "train.parquet")
    return model_dir, prompts, model


def test_an_actor_elsewhere_rebuilds_the_model_from_the_shipment_and_the_weight_server(head_files, tmp_path):
    model_dir, prompts, model = head_files
    shipment = pack(model_dir, prompts)
    assert "config.json" in shipment.model_files
    assert not [n for n in shipment.model_files if n.endswith(".safetensors")]  # weights never shipped
    # The learner has trained on: the weights it publishes differ from the saved base model's.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    server = WeightServer("tcp://127.0.0.1:0", NetSecurity(), bucket_bytes=64 << 10)
    client = WeightClient(server.address, NetSecurity(), actor_id=0)
    try:
        server.publish(model, 7)
        local_model, local_prompts, version = materialize(shipment, client, tmp_path / "actor")
    finally:
        client.close()
        server.close()
    assert version == 7
    rebuilt = AutoModelForCausalLM.from_pretrained(local_model)
    trained = model.state_dict()
    for name, tensor in rebuilt.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    tok, tok_local = AutoTokenizer.from_pretrained(model_dir), AutoTokenizer.from_pretrained(local_model)
    assert load_prompts(local_prompts, tok_local, 64) == load_prompts(prompts, tok, 64)


def test_waiting_for_weights_gives_up_with_the_server_named():
    server = WeightServer("tcp://127.0.0.1:0", NetSecurity(), bucket_bytes=1 << 20)
    client = WeightClient(server.address, NetSecurity(), actor_id=0)
    try:
        with pytest.raises(TimeoutError, match="published no weights") as err:
            first_weights(client, timeout_s=0.5)
        assert server.address in str(err.value)
    finally:
        client.close()
        server.close()
