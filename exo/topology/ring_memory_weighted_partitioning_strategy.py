from typing import List

from exo.topology.partitioning_strategy import Partition, PartitioningStrategy
from exo.topology.topology import Topology


class RingMemoryWeightedPartitioningStrategy(PartitioningStrategy):
  """Layers in proportion to memory; ring order = memory descending, ties by node id descending."""

  def partition(self, topology: Topology) -> List[Partition]:
    nodes = sorted(topology.all_nodes(), key=lambda item: (item[1].memory, item[0]), reverse=True)
    total = sum(caps.memory for _, caps in nodes)
    if total <= 0:  # upstream divides by zero here; share equally instead
      return [Partition(node_id, round(i / len(nodes), 5), round((i + 1) / len(nodes), 5)) for i, (node_id, _) in enumerate(nodes)]
    partitions, start = [], 0.0
    for node_id, caps in nodes:
      end = round(start + caps.memory / total, 5)
      partitions.append(Partition(node_id, start, end))
      start = end
    return partitions
