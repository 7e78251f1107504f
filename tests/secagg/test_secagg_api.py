"""The public surface of fedloom.secagg, and the import walls of every secagg module."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import fedloom.secagg

ROOT = Path(__file__).resolve().parents[2]
SECAGG_FILES = sorted((ROOT / "fedloom" / "secagg").glob("*.py"))

EXPORTED = {
    "MASK_KEY", "PRIME", "PROTOCOL_LABEL", "SEALED_SHARE_BYTES", "SELF_MASK", "SHARE_BYTES",
    "STAGE_OF", "SecAggClient", "SecAggResult", "SecAggServer", "SecAggStatus", "clip_delta",
    "AdvertiseKeysRequest", "AdvertisedKeys", "Confirmation", "ConsistencyReply",
    "ConsistencyRequest", "EncryptedShare", "KeyOffer", "MaskExpander",
    "MaskedInputReply", "MaskedInputRequest", "PeerVerifier", "RevealedShare", "RoundId",
    "RoundLedger", "DealerAccused", "accusation_failure", "accused_dealer",
    "RoundSetup", "SecAggConfig", "SecAggReply", "SecAggRequest", "ShareCommitment",
    "ShareKeysReply", "ShareKeysRequest", "SigningIdentity", "Stage", "UnmaskReply",
    "UnmaskRequest", "VerifiedPeer", "aes_ctr_keystream", "agree", "ceil_log2",
    "certificate_name", "commit_self_mask", "commit_share", "config_digest", "dequantize",
    "derive_mask_seed", "derive_share_key", "dropout_failure_bound", "expand_mask",
    "flatten", "generate_private_key", "graph_seed", "is_connected", "key_statement",
    "model_digest", "neighbour_graph", "new_seed", "open_share",
    "private_bytes", "private_key_from_bytes", "public_bytes", "quantize", "reconstruct",
    "ring_offsets", "ring_order", "seal_share", "split", "split_mask_seed",
    "survivors_statement", "unflatten", "usable_public_key",
}


def test_exported_names_are_pinned() -> None:
    assert set(fedloom.secagg.__all__) == EXPORTED
    assert all(hasattr(fedloom.secagg, name) for name in EXPORTED)


def test_stage_names_are_the_wire_names() -> None:
    assert [str(s) for s in fedloom.secagg.Stage] == [
        "advertise_keys", "share_keys", "masked_input", "consistency", "unmask"]


def test_every_message_type_belongs_to_its_stage() -> None:
    secagg = fedloom.secagg
    assert secagg.STAGE_OF[secagg.ConsistencyRequest] is secagg.Stage.CONSISTENCY
    assert secagg.STAGE_OF[secagg.ConsistencyReply] is secagg.Stage.CONSISTENCY
    # one request and one reply type per stage
    assert sorted(map(str, secagg.STAGE_OF.values())) == sorted(
        [str(s) for s in secagg.Stage] * 2)


def test_the_protocol_label_is_v4() -> None:
    assert fedloom.secagg.PROTOCOL_LABEL == b"fedloom/secagg/v4/"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_import_walls() -> None:
    forbidden = ("grpc", "google", "torch", "flwr", "asyncio", "threading")
    for path in SECAGG_FILES:
        for name in _imports(path):
            assert not name.startswith(forbidden), f"{path.name} imports {name}"
            if name.startswith("fedloom."):
                # fedloom.settings: the config helpers (pure, they import only the errors)
                allowed = ("fedloom.secagg", "fedloom.errors", "fedloom.weights",
                           "fedloom.settings")
                assert name.startswith(allowed), f"{path.name} imports {name}"
    assert len(SECAGG_FILES) >= 10


def test_kernel_package_loads_without_transport_or_ml_libraries() -> None:
    code = ("import sys, fedloom.secagg; bad = [m for m in sys.modules if m.split('.')[0] in "
            "('grpc', 'google', 'torch', 'flwr')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
