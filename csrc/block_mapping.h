// Host-side checks of a block mapping ([num_pairs, 2] of (src_block, dst_block)), shared by the
// CPU and CUDA copy_blocks / swap_blocks so both reject the same mappings with the same words.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace pagedserve {

inline std::string block_pair_name(int64_t pair, int column) {
  return "block_mapping[" + std::to_string(pair) + "][" + std::to_string(column) + "]";
}

inline void check_block_in_pool(int64_t block, int64_t num_blocks, int64_t pair, int column) {
  if (block < 0 || block >= num_blocks) {
    throw std::invalid_argument(block_pair_name(pair, column) + " = " + std::to_string(block) +
                                " is outside [0, " + std::to_string(num_blocks) + ")");
  }
}

// Throws std::invalid_argument unless every source lies in [0, src_num_blocks), every
// destination in [0, dst_num_blocks), destinations are distinct (parallel copies would race)
// and, inside one pool (same_pool), no source is also a destination (copies must not chain).
inline void check_block_mapping(const int64_t* block_mapping, int64_t num_pairs,
                                int64_t src_num_blocks, int64_t dst_num_blocks, bool same_pool) {
  for (int64_t i = 0; i < num_pairs; ++i) {
    check_block_in_pool(block_mapping[2 * i], src_num_blocks, i, 0);
    check_block_in_pool(block_mapping[2 * i + 1], dst_num_blocks, i, 1);
  }
  std::vector<int64_t> destinations(num_pairs);
  for (int64_t i = 0; i < num_pairs; ++i) destinations[i] = block_mapping[2 * i + 1];
  std::sort(destinations.begin(), destinations.end());
  const auto repeated = std::adjacent_find(destinations.begin(), destinations.end());
  if (repeated != destinations.end()) {
    throw std::invalid_argument("block_mapping names destination block " +
                                std::to_string(*repeated) + " more than once");
  }
  if (!same_pool) return;
  for (int64_t i = 0; i < num_pairs; ++i) {
    const int64_t src = block_mapping[2 * i];
    if (std::binary_search(destinations.begin(), destinations.end(), src)) {
      throw std::invalid_argument(block_pair_name(i, 0) + " = " + std::to_string(src) +
                                  " is also a destination; copies must not chain");
    }
  }
}

}  // namespace pagedserve
