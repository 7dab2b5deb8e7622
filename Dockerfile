# MLPerf BERT harness on NVIDIA's PyTorch container (CUDA, NCCL and a CUDA build of torch included).
#   docker build -t mlperf-bert .
#   docker run ... mlperf-bert bash -c 'source config_DGXA100_1x8x56x1.sh && ./run_and_time.sh'
#   (the whole command, with the mounts and the -e paths the configs need inside: README, "Running on a real cluster")
# run.sub uses the same image through pyxis: CONT=<registry>#<path>:<tag> or a .sqsh file (enroot import)
# 25.12: torch 2.10.0a0, CUDA 13.1 (NVIDIA's release notes). The harness needs torch >= 2.10 (checked below);
# 25.01's torch 2.6 fails its tests. The GPU measurements in the README ran torch 2.11.0+cu130 with torchao 0.18.0.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.12-py3
FROM ${BASE_IMAGE}

WORKDIR /workspace/bert
# Everything but torch: requirements.txt pins the CPU wheel, the image's own CUDA build must stay.
COPY requirements.txt .
RUN grep -v '^torch==' requirements.txt >/tmp/requirements-image.txt \
 && pip install --no-cache-dir -r /tmp/requirements-image.txt \
 && rm /tmp/requirements-image.txt

COPY . .
# PRECISION=fp8 (bert/model/fp8.py): torchao's float8 training, in the release built for the image's torch, as
# bert.model.fp8.torchao_release() names it (its TORCHAO: 0.16.0 for 2.10, 0.18.0 for 2.11 and newer);
# --build-arg TORCHAO=x.y.z overrides it. Not in requirements.txt: the CPU install has no float8 hardware.
ARG TORCHAO=
RUN pip install --no-cache-dir --no-deps --no-build-isolation -e . \
 && python3 -c "from bert.train.config import check_torch; check_torch()" \
 && pip install --no-cache-dir --no-deps "torchao==${TORCHAO:-$(python3 -c 'from bert.model.fp8 import torchao_release; print(torchao_release())')}"
