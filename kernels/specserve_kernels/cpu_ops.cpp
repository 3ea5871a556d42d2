/* The C kernels' torch operators, implemented in C++ (kernels/specserve_kernels/cpu_ops.py): a compiled graph's
   call then reaches the kernel through torch's dispatcher alone. Implemented in Python, each call
   also ran the Python function and ctypes' argument conversion, some 4 us, and a batch-1 decode step
   of the default model makes 151 of them (121 int4 products, 30 attentions).

   The operators' schemas are defined in Python, beside their Python implementations (the fallback
   where this file cannot be built). `specserve_implement(name, kernel)` registers the C++
   implementation of one operator on torch's CPU dispatch key, calling `kernel`: the function of
   the C library kernels/specserve_kernels/int4_cpu.py or kernels/specserve_kernels/paged_attention_cpu.py loaded for this CPU. */
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cstring>
#include <memory>
#include <vector>

namespace {

/* int4_cpu.c's int4_linear and paged_attention_cpu.c's paged_attention */
using Int4Kernel = void (*)(const float *x, int64_t m, int64_t k, const uint8_t *qs, const void *scale,
                            const void *minimum, int64_t out, float *y, int threads);
using AttentionKernel = void (*)(const float *q, const float *k_cache, const float *v_cache,
                                 const int32_t *cu_seqlens, const int32_t *seq_lens, const int32_t *block_tables,
                                 int64_t batch, int64_t max_blocks, int64_t heads, int64_t kv_heads, int64_t d,
                                 int64_t block_size, int64_t pool_blocks, float scale, float *out, int threads);

Int4Kernel int4_kernel = nullptr;
AttentionKernel attention_kernel = nullptr;

at::Tensor int4_linear(const at::Tensor &x, const at::Tensor &qs, const at::Tensor &scale,
                       const at::Tensor &minimum) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int4_linear: x must be [rows, in] float32");
    const int64_t out = qs.size(0), blocks = x.size(1) / 32;
    TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == at::kByte && qs.is_contiguous() && x.size(1) % 32 == 0 &&
                    qs.size(1) * 2 == x.size(1),
                "int4_linear: qs must be [out, in / 2] uint8 (contiguous), in a multiple of 32");
    for (const at::Tensor *t : {&scale, &minimum})
        TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 2 && t->size(0) == out &&
                        t->size(1) == blocks,
                    "int4_linear: scale and minimum must be [out, in / 32] float16 (contiguous)");
    const at::Tensor rows = x.contiguous();
    at::Tensor y = at::empty({rows.size(0), out}, rows.options());
    int4_kernel(rows.data_ptr<float>(), rows.size(0), rows.size(1), qs.data_ptr<uint8_t>(), scale.data_ptr(),
                minimum.data_ptr(), out, y.data_ptr<float>(), at::get_num_threads());
    return y;
}

/* backend/model/quantized_linear.py's int4_product: from dense_min_rows rows on, the layer's dense
   copy multiplies (the Python operator specserve::dense_product, which holds the copies) */
at::Tensor int4_product(const at::Tensor &x, const at::Tensor &qs, const at::Tensor &scale, const at::Tensor &minimum,
                        int64_t dense, int64_t dense_min_rows) {
    if (dense >= 0 && x.size(0) >= dense_min_rows) {
        static const auto dense_product = c10::Dispatcher::singleton()
                                              .findSchemaOrThrow("specserve::dense_product", "")
                                              .typed<at::Tensor(const at::Tensor &, int64_t)>();
        return dense_product.call(x, dense);
    }
    return int4_linear(x, qs, scale, minimum);
}

at::Tensor int32_contiguous(const at::Tensor &t) {
    return t.scalar_type() == at::kInt && t.is_contiguous() ? t : t.to(at::kInt).contiguous();
}

at::Tensor paged_attention(const at::Tensor &q, const at::Tensor &k_cache, const at::Tensor &v_cache,
                           const at::Tensor &cu_seqlens_q, const at::Tensor &seq_lens, const at::Tensor &block_tables,
                           double scale) {
    TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.scalar_type() == at::kFloat &&
                    k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat &&
                    k_cache.is_contiguous() && v_cache.is_contiguous(),
                "paged_attention: q [tokens, heads, head_dim] and contiguous caches, all float32");
    TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && q.size(2) == k_cache.size(3) && q.size(2) % 16 == 0 &&
                    q.size(1) % k_cache.size(2) == 0,
                "paged_attention: caches [blocks, block_size, kv_heads, head_dim] alike, q's heads a multiple of "
                "kv_heads, head_dim a multiple of 16");
    const at::Tensor query = q.contiguous();
    const at::Tensor cu = int32_contiguous(cu_seqlens_q), lens = int32_contiguous(seq_lens),
                     tables = int32_contiguous(block_tables);
    TORCH_CHECK(lens.dim() == 1 && cu.dim() == 1 && cu.size(0) == lens.size(0) + 1 && tables.dim() == 2 &&
                    tables.size(0) == lens.size(0) && cu.data_ptr<int32_t>()[lens.size(0)] <= query.size(0),
                "paged_attention: cu_seqlens_q [batch + 1] (at most q's tokens), seq_lens [batch], "
                "block_tables [batch, pages]");
    at::Tensor out = at::empty_like(query);
    attention_kernel(query.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                     cu.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), tables.data_ptr<int32_t>(), lens.size(0),
                     tables.size(1), query.size(1), k_cache.size(2), k_cache.size(3), k_cache.size(1),
                     k_cache.size(0), static_cast<float>(scale), out.data_ptr<float>(), at::get_num_threads());
    return out;
}

std::vector<std::unique_ptr<torch::Library>> registrations;

}  // namespace

/* Registers operator specserve::<name>'s CPU implementation here, calling `kernel`; 0 where this
   file has none of that name. */
extern "C" int specserve_implement(const char *name, void *kernel) {
    auto library = std::make_unique<torch::Library>(torch::Library::IMPL, "specserve", c10::DispatchKey::CPU,
                                                    __FILE__, __LINE__);
    if (std::strcmp(name, "int4_linear") == 0) {
        int4_kernel = reinterpret_cast<Int4Kernel>(kernel);
        library->impl("int4_linear", TORCH_FN(int4_linear));
    } else if (std::strcmp(name, "int4_product") == 0) {
        int4_kernel = reinterpret_cast<Int4Kernel>(kernel);
        library->impl("int4_product", TORCH_FN(int4_product));
    } else if (std::strcmp(name, "paged_attention") == 0) {
        attention_kernel = reinterpret_cast<AttentionKernel>(kernel);
        library->impl("paged_attention", TORCH_FN(paged_attention));
    } else {
        return 0;
    }
    registrations.push_back(std::move(library));
    return 1;
}
