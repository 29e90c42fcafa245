// medusa::fbgemm_sums's CPU kernel in C++ (prepack.py builds it once per machine; its Python twin is the fallback).
// A w8a8 step on fbgemm calls the op once per linear group, 121 times for SmolLM2, from inside an AOTInductor package:
// a Python kernel costs a trip through the interpreter each time, this one none (docs/engines.md, "w8a8 on AVX2").
#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/library.h>

#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

// fbgemm's packed copy of an int8 weight (N, K), each output row's sum of levels (fbgemm's zero-point term) and a zero
// bias, made on first use and kept while the weight's storage lives (a quantised target's weights are never written
// again; a weight written in place, seen by its version counter, is packed again).
struct Packed {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  const c10::StorageImpl* storage_seen;
  uint32_t version;
  std::vector<int64_t> sizes;
  at::Tensor packed, row_sums, zero_bias;

  bool of(const at::Tensor& weight, uint32_t now) const {
    return !storage.expired() && storage_seen == weight.storage().unsafeGetStorageImpl() && version == now &&
           sizes == weight.sizes().vec();
  }
};

// torch calls both fbgemm functions deprecated (since 1.x); they are fbgemm's one int8 GEMM on plain tensors
struct Quiet : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

std::mutex lock;
std::unordered_map<const void*, Packed> packs;  // by where the weight's values lie

Packed packed_weight(const at::Tensor& weight) {  // a copy: another thread may pack a weight again meanwhile
  std::lock_guard<std::mutex> guard(lock);
  const void* key = weight.data_ptr();
  const auto version = weight.unsafeGetTensorImpl()->version_counter().current_version();
  auto found = packs.find(key);
  if (found != packs.end() && found->second.of(weight, version)) {
    return found->second;
  }
  for (auto it = packs.begin(); it != packs.end();) {  // drop the copies of weights that are gone
    it = it->second.storage.expired() ? packs.erase(it) : std::next(it);
  }
  Quiet quiet;
  c10::WarningUtils::WarningHandlerGuard quietly(&quiet);
  Packed entry{weight.storage().getWeakStorageImpl(), weight.storage().unsafeGetStorageImpl(), version,
               weight.sizes().vec(), at::fbgemm_pack_quantized_matrix(weight), weight.sum({1}, false, at::kInt),
               at::zeros({weight.size(0)}, weight.options().dtype(at::kFloat))};
  return packs.insert_or_assign(key, std::move(entry)).first->second;
}

at::Tensor fbgemm_sums(const at::Tensor& pinned, const at::Tensor& weight) {
  const Packed entry = packed_weight(weight);
  Quiet quiet;
  c10::WarningUtils::WarningHandlerGuard quietly(&quiet);
  return at::fbgemm_linear_int8_weight_fp32_activation(pinned, weight, entry.packed, entry.row_sums, 1.0, 0,
                                                       entry.zero_bias);
}

}  // namespace

TORCH_LIBRARY_IMPL(medusa, CPU, m) { m.impl("fbgemm_sums", fbgemm_sums); }
