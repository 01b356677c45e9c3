from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import List

from exo.inference.shard import Shard
from exo.topology.topology import Topology


@dataclass
class Partition:
  node_id: str
  start: float  # fraction of the layer space, inclusive
  end: float  # exclusive


class PartitioningStrategy(ABC):
  @abstractmethod
  def partition(self, topology: Topology) -> List[Partition]:
    ...


def map_partitions_to_shards(partitions: List[Partition], num_layers: int, model_id: str) -> List[Shard]:
  shards = []
  for i, partition in enumerate(partitions):
    start = int(partition.start * num_layers)
    end = num_layers - 1 if i == len(partitions) - 1 else int(partition.end * num_layers) - 1
    if start <= end:
      shards.append(Shard(model_id, start, end, num_layers))
  if shards and shards[-1].end_layer < num_layers - 1:
    last = shards[-1]
    shards[-1] = Shard(model_id, last.start_layer, num_layers - 1, num_layers)
  return shards
