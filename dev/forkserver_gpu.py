"""Issue 63: does each pool worker run on the GPU it was given?

    PYTHONPATH=dev python3 dev/forkserver_gpu.py

Starts the fork server as a spread command does (pool.warm), then a Pool with a worker per visible
GPU, started from threads at once as a run starts them; each worker reports its
CUDA_VISIBLE_DEVICES, whether it is the fork server's child, whether libcuda was mapped into it
before it touched CUDA, the devices it sees and the first one's UUID (distinct UUIDs: a GPU each).
Session 37 found with it that workers forked from the fork server do see their own GPU; what put
three of four on the first GPU was reading the GPU list while another worker's start had set
CUDA_VISIBLE_DEVICES in the parent (fixed: Pool reads every worker's variables up front)."""
import os
import threading
import time


def child():
    pre = "libcuda" in open("/proc/self/maps").read()
    import torch
    n = torch.cuda.device_count()
    return (os.environ.get("CUDA_VISIBLE_DEVICES"), os.getppid() != int(os.environ["PROBE_PARENT"]),
            f"libcuda before CUDA: {pre}", f"devices {n}", str(torch.cuda.get_device_properties(0).uuid) if n else "-")


if __name__ == "__main__":
    from mhctool import pool
    os.environ["PROBE_PARENT"] = str(os.getpid())
    gpus = pool.visible_gpus()
    pool.warm(len(gpus))
    time.sleep(5)
    with pool.Pool(len(gpus), "cuda") as p:
        threads = [threading.Thread(target=lambda k=k: p._worker(k).start()) for k in range(len(gpus))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for k in range(len(gpus)):
            value, failure = p._worker(k).call("forkserver_gpu:child", (), timeout=120)
            print(f"worker {k}: (variable, forked, libcuda, devices, uuid) =", value or failure)
