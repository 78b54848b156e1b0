"""Issue 63: does a child of the fork server take the GPU its CUDA_VISIBLE_DEVICES names?

    PYTHONPATH=dev MHCTOOL_FORK_GPU_WORKERS=1 python3 dev/forkserver_gpu.py   (forked, as up to session 36)
    PYTHONPATH=dev python3 dev/forkserver_gpu.py                              (as shipped: spawned)

Starts the fork server as a spread command does (pool.warm), then a worker per entry of
CUDA_VISIBLE_DEVICES ("" too); each reports its variable, whether libcuda was mapped into it before
it touched CUDA, the devices it sees and the first one's UUID. The fork server's own state (libcuda
mapped or not) is printed first."""
import os
import time


def child():
    pre = "libcuda" in open("/proc/self/maps").read()
    import torch
    n = torch.cuda.device_count()
    return (os.environ.get("CUDA_VISIBLE_DEVICES"), os.getppid() != int(os.environ["PROBE_PARENT"]),
            f"libcuda before CUDA: {pre}", f"devices {n}", str(torch.cuda.get_device_properties(0).uuid) if n else "-")


def server():
    from multiprocessing import forkserver
    pid = forkserver._forkserver._forkserver_pid
    return pid, "libcuda" in open(f"/proc/{pid}/maps").read() if pid else None


if __name__ == "__main__":
    from mhctool import pool
    from mhctool.isolation import Worker
    os.environ["PROBE_PARENT"] = str(os.getpid())
    pool.warm(2)
    time.sleep(8)  # the server up, torch imported there
    print("fork server (pid, libcuda mapped):", server())
    for gpu in ("1", "3", ""):
        with Worker(daemon=False, env={"CUDA_VISIBLE_DEVICES": gpu}) as w:
            value, failure = w.call("forkserver_gpu:child", (), timeout=120)
            print(f"CUDA_VISIBLE_DEVICES={gpu!r}: (variable, forked, libcuda, devices, uuid) =", value or failure)
    print("fork server after:", server())
