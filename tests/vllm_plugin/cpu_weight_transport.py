"""A CPU stand-in for the data plane of vLLM's NCCL weight transfer, for the tests (vLLM 0.32's NCCL engine needs
CUDA). Everything else on the nccl route runs as it does on GPUs: the trainer's NCCLTrainerWeightTransferEngine
(trainer_init, send_weights) with HTTPVLLMWeightSyncClient, the server's /init_weight_transfer_engine,
/start_weight_update, /update_weights and /finish_weight_update, and the worker's NCCLWeightTransferEngine with its
layerwise reload into the served model. Swapped are the four data-plane functions of vllm's nccl_engine module: the
group's rendezvous (a TCPStore group instead of an NCCL communicator) and the packed broadcast (a tensor at a time
through the store instead of packed buffers on CUDA streams).

The servers load it through the `vllm.general_plugins` entry point of the dist-info beside it (this folder on their
PYTHONPATH); a trainer in a test patches the same names from DATA_PLANE."""

import torch


class StoreGroup:
    """The two calls the NCCL engines make on their communicator (broadcast, destroy), through a TCPStore."""

    def __init__(self, host: str, port: int, rank: int, world_size: int):
        from vllm.distributed.utils import StatelessProcessGroup

        self.group = StatelessProcessGroup.create(host, port, rank, world_size)

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        got = self.group.broadcast_obj(tensor.cpu() if self.group.rank == src else None, src)
        if self.group.rank != src:
            tensor.copy_(got)

    def destroy(self) -> None:
        self.group = None


def trainer_endpoint(init_info, rank: int = 0) -> StoreGroup:
    return StoreGroup(init_info.master_address, init_info.master_port, rank, init_info.world_size)


def worker_group(init_info, parallel_config) -> StoreGroup:
    rank = parallel_config.rank + init_info.rank_offset  # tensor parallel 1, one data-parallel rank
    return StoreGroup(init_info.master_address, init_info.master_port, rank, init_info.world_size)


def producer(iterator, group, src, post_iter_func, buffer_size_bytes, num_buffers) -> None:
    for item in iterator:
        group.broadcast(post_iter_func(item), src=src)


def consumer(iterator, group, src, post_unpack_func, buffer_size_bytes, num_buffers, device) -> None:
    for name, (shape, dtype) in iterator:
        tensor = torch.empty(shape, dtype=dtype, device=device)
        group.broadcast(tensor, src=src)
        post_unpack_func([(name, tensor)])


DATA_PLANE = {  # the names in vllm.distributed.weight_transfer.nccl_engine that the NCCL engines call
    "open_trainer_endpoint": trainer_endpoint,
    "worker_init_process_group": worker_group,
    "packed_nccl_broadcast_producer": producer,
    "packed_nccl_broadcast_consumer": consumer,
}


def install() -> None:
    from vllm.distributed.weight_transfer import nccl_engine

    for name, function in DATA_PLANE.items():
        setattr(nccl_engine, name, function)
