# Sourced by the sbatch scripts: multi-node rendezvous and the network settings, in one place.
# shellcheck shell=bash

# One torchrun per node (srun --ntasks-per-node=1); torchrun starts GPUS_PER_NODE ranks on each and they
# meet at the first node of the allocation through torch's c10d rendezvous (no etcd, no extra service).
: "${GPUS_PER_NODE:=8}"
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export HEAD_NODE
export RDZV_PORT=${RDZV_PORT:-29500}
export TORCHRUN="torchrun --nnodes=$SLURM_NNODES --nproc_per_node=$GPUS_PER_NODE \
  --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:$RDZV_PORT --rdzv_id=$SLURM_JOB_ID"

# NCCL over AWS EFA (p4d/p5/trn-class instances). Harmless elsewhere: without the EFA libfabric
# provider NCCL falls back to sockets, and the other settings are plain NCCL ones.
export FI_PROVIDER=${FI_PROVIDER:-efa}
export FI_EFA_USE_DEVICE_RDMA=${FI_EFA_USE_DEVICE_RDMA:-1}   # GPUDirect RDMA (p4d and newer)
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}  # a dead peer fails the job, not hangs
# export NCCL_SOCKET_IFNAME=^lo,docker   # set if the bootstrap picks the wrong interface

# The torch.compile cache shared by the compile job and the run job (must be on a shared filesystem);
# the trainer points Inductor's caches there (trainer.compile_cache_dir).
export COMPILE_CACHE=${COMPILE_CACHE:-$PWD/compile_cache}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
