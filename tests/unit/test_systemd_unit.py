"""The shipped systemd unit keeps its sandbox: the hardening directives are there, the GPU
drop-in opens the NVIDIA devices only, and ``systemd-analyze security`` (where installed)
rates the unit, with and without the drop-in, below 5.0."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SYSTEMD_DIR = Path(__file__).resolve().parents[2] / "tools" / "systemd"
UNIT_PATH = SYSTEMD_DIR / "pagedserve.service"
GPU_DROP_IN_PATH = SYSTEMD_DIR / "pagedserve-gpu.conf"
# systemd-analyze's scale: 0 (sandboxed) to 10; below 5 it says "OK" or better.
MAX_EXPOSURE = 5.0


def service_settings(path: Path) -> dict[str, list[str]]:
    """Each key of the file's [Service] section with its assignments in order (a key may be
    assigned more than once; an empty assignment resets the list in systemd)."""
    settings: dict[str, list[str]] = {}
    section = None
    logical_line = ""
    for raw_line in path.read_text().splitlines():
        line = raw_line.strip()
        if not logical_line and (not line or line.startswith(("#", ";"))):
            continue
        if line.endswith("\\"):
            logical_line += line[:-1] + " "
            continue
        line, logical_line = logical_line + line, ""
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif section == "Service":
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def test_unit_sets_the_hardening_directives():
    settings = service_settings(UNIT_PATH)
    assert settings["NoNewPrivileges"] == ["yes"]
    assert settings["ProtectSystem"] == ["strict"]
    assert settings["ProtectHome"] == ["yes"]
    assert settings["PrivateTmp"] == ["yes"]
    assert settings["PrivateDevices"] == ["yes"]
    # An empty assignment alone: no capability at all, not the default full set.
    assert settings["CapabilityBoundingSet"] == [""]
    assert settings["AmbientCapabilities"] == [""]
    assert "@system-service" in settings["SystemCallFilter"]
    assert settings["SystemCallArchitectures"] == ["native"]
    assert settings["UMask"] == ["0077"]


def test_unit_allows_the_socket_families_the_server_uses_and_no_others():
    (families,) = service_settings(UNIT_PATH)["RestrictAddressFamilies"]
    # Unix: ZeroMQ and sd_notify; inet: the ports; netlink: gloo's getifaddrs().
    assert sorted(families.split()) == ["AF_INET", "AF_INET6", "AF_NETLINK", "AF_UNIX"]


def test_unit_leaves_writable_executable_memory_to_the_jit_compilers():
    # MemoryDenyWriteExecute=yes makes oneDNN's bfloat16 kernels (and CUDA's JIT) fail.
    assert service_settings(UNIT_PATH).get("MemoryDenyWriteExecute", ["no"]) == ["no"]


def test_gpu_drop_in_opens_the_nvidia_devices_only():
    settings = service_settings(GPU_DROP_IN_PATH)
    assert settings["PrivateDevices"] == ["no"]
    assert settings["DevicePolicy"] == ["closed"]
    assert sorted(settings["DeviceAllow"]) == ["char-nvidia-frontend rw", "char-nvidia-uvm rw"]


def security_report(*args: str) -> tuple[float, str]:
    """The overall exposure ``systemd-analyze security --offline=true ARGS`` reports, and
    the whole report."""
    systemd_analyze = shutil.which("systemd-analyze")
    if systemd_analyze is None:
        pytest.skip("systemd-analyze is not installed")
    completed = subprocess.run(
        [systemd_analyze, "security", "--offline=true", *args],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=30,
    )
    output = completed.stdout + completed.stderr
    if "unrecognized option" in output:
        pytest.skip("this systemd-analyze has no --offline (systemd 250 added it)")
    match = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", output)
    assert match is not None, f"no overall exposure in systemd-analyze's output:\n{output}"
    return float(match.group(1)), output


def test_systemd_analyze_rates_the_unit_below_the_limit():
    exposure, _ = security_report(str(UNIT_PATH))
    assert exposure < MAX_EXPOSURE


def test_systemd_analyze_rates_the_unit_with_the_gpu_drop_in_below_the_limit(tmp_path):
    unit_dir = tmp_path / "etc" / "systemd" / "system"
    drop_in_dir = unit_dir / "pagedserve.service.d"
    drop_in_dir.mkdir(parents=True)
    shutil.copy(UNIT_PATH, unit_dir / UNIT_PATH.name)
    shutil.copy(GPU_DROP_IN_PATH, drop_in_dir / "gpu.conf")
    exposure, report = security_report(f"--root={tmp_path}", UNIT_PATH.name)
    assert "char-nvidia-uvm:rw" in report  # the drop-in was read
    assert exposure < MAX_EXPOSURE


RAY_UNIT_PATH = SYSTEMD_DIR / "pagedserve-ray.service"
RAY_DROP_IN_PATH = SYSTEMD_DIR / "pagedserve-ray.conf"


def test_ray_node_unit_runs_ray_in_the_foreground_in_a_sandbox():
    settings = service_settings(RAY_UNIT_PATH)
    (exec_start,) = settings["ExecStart"]
    assert "/ray start --block " in exec_start and "$RAY_START_ARGS" in exec_start
    assert settings["User"] == service_settings(UNIT_PATH)["User"]  # one user: shared sockets
    assert settings["NoNewPrivileges"] == ["yes"]
    assert settings["ProtectSystem"] == ["strict"]
    assert settings["CapabilityBoundingSet"] == [""]
    # The engine's sockets (the server's runtime directory) and ring (the host's /dev/shm).
    assert settings["ReadWritePaths"] == ["-/run/pagedserve"]
    assert settings["PrivateDevices"] == ["no"] and settings["DevicePolicy"] == ["closed"]


def test_server_drop_in_for_ray_shares_dev_shm_and_needs_the_node():
    settings = service_settings(RAY_DROP_IN_PATH)
    assert settings["PrivateDevices"] == ["no"] and settings["DevicePolicy"] == ["closed"]
    text = RAY_DROP_IN_PATH.read_text()
    assert "Requires=pagedserve-ray.service" in text and "After=pagedserve-ray.service" in text


def test_systemd_analyze_rates_the_ray_node_unit_below_the_limit():
    exposure, _ = security_report(str(RAY_UNIT_PATH))
    assert exposure < MAX_EXPOSURE
