"""Test doubles for hardware that this machine does not have (Ascend NPU). See each module's docstring."""
