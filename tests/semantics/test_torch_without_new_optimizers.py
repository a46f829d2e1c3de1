"""``import sharded_opt`` on a torch without Muon or Adafactor (torch before 2.9 has no Muon):
the table of torch's classes leaves out what the installed torch lacks, and nothing else reads
those classes at import."""

from __future__ import annotations

import subprocess
import sys
import types

import torch

from sharded_opt.guards import optimizer_needs

IMPORT_WITHOUT_THEM = """
import torch
del torch.optim.Muon, torch.optim.Adafactor
import sharded_opt, sharded_opt.integrations
from sharded_opt.guards.optimizer_needs import TORCH_OPTIMIZERS
assert torch.optim.AdamW in TORCH_OPTIMIZERS and len(TORCH_OPTIMIZERS) == 11
print("ok")
"""


def test_import_works_on_a_torch_without_muon_and_adafactor():
    found = subprocess.run(
        [sys.executable, "-c", IMPORT_WITHOUT_THEM], capture_output=True, text=True, check=False
    )
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == "ok"


def test_the_table_has_the_whole_param_classes_the_installed_torch_has():
    assert optimizer_needs.TORCH_OPTIMIZERS[torch.optim.Muon] is optimizer_needs.MUON
    assert optimizer_needs.TORCH_OPTIMIZERS[torch.optim.Adafactor] is optimizer_needs.ADAFACTOR
    older = types.SimpleNamespace(Adafactor=torch.optim.Adafactor)  # a torch with Adafactor only
    table = optimizer_needs.torch_optimizers(older)
    assert torch.optim.Muon not in table and table[torch.optim.Adafactor] is optimizer_needs.ADAFACTOR
    assert all(table[cls] is optimizer_needs.ELEMENTWISE for cls in optimizer_needs.ELEMENTWISE_CLASSES)
