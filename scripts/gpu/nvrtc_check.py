#!/usr/bin/env python3
"""Compile a k3rs .cu (common.cuh prepended) with the PyPI NVRTC for sm_90, without a GPU, and
print the log plus per-kernel resource usage (cuobjdump from Triton's package when present).
Usage: nvrtc_check.py crates/k3-core/src/kernels/cuda/kda.cu  (extra options in $NVRTC_OPTS, e.g.
"--ptxas-options=-v" for spill counts)"""
import ctypes, glob, os, subprocess, sys, tempfile

import nvidia
libdir = glob.glob(os.path.join(nvidia.__path__[0], "*", "lib"))
lib = None
for d in libdir:
    for f in glob.glob(os.path.join(d, "libnvrtc.so*")):
        if "builtins" not in f:
            lib = ctypes.CDLL(f)
if lib is None:
    sys.exit("no libnvrtc found (pip install nvidia-cuda-nvrtc)")
src_path = sys.argv[1]
common = open(os.path.join(os.path.dirname(src_path), "common.cuh")).read()
text = (common + "\n" + open(src_path).read()).encode()
prog = ctypes.c_void_p()
assert lib.nvrtcCreateProgram(ctypes.byref(prog), text, os.path.basename(src_path).encode(), 0, None, None) == 0
opts = [b"-std=c++17", b"--gpu-architecture=sm_90"] + [o.encode() for o in os.environ.get("NVRTC_OPTS", "").split()]
arr = (ctypes.c_char_p * len(opts))(*opts)
rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
n = ctypes.c_size_t()
lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
log = ctypes.create_string_buffer(n.value)
lib.nvrtcGetProgramLog(prog, log)
print(log.value.decode())
if rc != 0:
    sys.exit(f"compile failed rc={rc}")
lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
cub = ctypes.create_string_buffer(n.value)
lib.nvrtcGetCUBIN(prog, cub)
out = tempfile.mktemp(suffix=".cubin")
open(out, "wb").write(cub.raw)
tools = glob.glob(os.path.join(os.path.dirname(nvidia.__path__[0]), "triton/backends/nvidia/bin/cuobjdump"))
if tools:
    print(subprocess.run([tools[0], "-res-usage", out], capture_output=True, text=True).stdout)
print("ok", out)
