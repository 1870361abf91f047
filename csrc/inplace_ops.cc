// TensorFlow's InplaceUpdate, InplaceAdd and InplaceSub (tf.raw_ops) write
// into their input `x` whoever owns it: TF's kernel aliases its output to x
// on purpose (tensorflow/core/kernels/inplace_ops.cc, InplaceOpBase), so no
// buffer ownership can stop them. Registered here above TF's own kernels,
// they compute the same result, but when `x` is a tfray batch they first
// copy it: Ray's object store is never written. Other inputs are updated in
// place, as TF's kernels do.
#include <cstdint>
#include <cstring>
#include <functional>

#include "absl/strings/str_cat.h"
#include "batch_buffer.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace tfray {
namespace {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;

enum class Inplace { kUpdate, kAdd, kSub };

// y[i[j] mod rows] = op(that row, v[j]) for each j, row by row.
template <typename T, typename Op>
void ApplyRows(const Tensor& i, const Tensor& v, Tensor* y, Op op) {
  const auto rows = i.flat<int32_t>();
  const auto from = v.flat_outer_dims<T>();
  auto to = y->flat_outer_dims<T>();
  const int64_t num_rows = to.dimension(0);
  const int64_t row_size = to.dimension(1);
  for (int64_t j = 0; j < rows.size(); ++j) {
    const int64_t r = (rows(j) % num_rows + num_rows) % num_rows;
    for (int64_t c = 0; c < row_size; ++c) to(r, c) = op(to(r, c), from(j, c));
  }
}

// Every dtype TF's kernels take: all for an update, numbers for add/sub.
absl::Status ApplyAny(Inplace kind, const Tensor& i, const Tensor& v,
                      Tensor* y) {
  const auto update = [](const auto&, const auto& b) { return b; };
  switch (v.dtype()) {
#define TFRAY_NUMBER_CASE(T)                                 \
  case tensorflow::DataTypeToEnum<T>::value:                 \
    if (kind == Inplace::kAdd) {                             \
      ApplyRows<T>(i, v, y, std::plus<T>());                 \
    } else if (kind == Inplace::kSub) {                      \
      ApplyRows<T>(i, v, y, std::minus<T>());                \
    } else {                                                 \
      ApplyRows<T>(i, v, y, update);                         \
    }                                                        \
    return absl::OkStatus();
    TF_CALL_NUMBER_TYPES(TFRAY_NUMBER_CASE)
#undef TFRAY_NUMBER_CASE
    case tensorflow::DT_BOOL:
      if (kind != Inplace::kUpdate) break;
      ApplyRows<bool>(i, v, y, update);
      return absl::OkStatus();
    case tensorflow::DT_STRING:
      if (kind != Inplace::kUpdate) break;
      ApplyRows<tensorflow::tstring>(i, v, y, update);
      return absl::OkStatus();
    default:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("Unsupported data type: ",
                   tensorflow::DataTypeString(v.dtype())));
}

template <Inplace kind>
class InplaceOp : public OpKernel {
 public:
  explicit InplaceOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& i = ctx->input(1);
    const Tensor& v = ctx->input(2);
    OP_REQUIRES(ctx, tensorflow::TensorShapeUtils::IsVector(i.shape()),
                absl::InvalidArgumentError(absl::StrCat(
                    "i must be a vector. ", i.shape().DebugString())));
    OP_REQUIRES(ctx, x.dims() == v.dims(),
                absl::InvalidArgumentError(absl::StrCat(
                    "x and v shape doesn't match (ranks differ): ",
                    x.shape().DebugString(), " vs. ", v.shape().DebugString())));
    for (int d = 1; d < x.dims(); ++d) {
      OP_REQUIRES(ctx, x.dim_size(d) == v.dim_size(d),
                  absl::InvalidArgumentError(absl::StrCat(
                      "x and v shape doesn't match at index ", d, " : ",
                      x.shape().DebugString(), " vs. ",
                      v.shape().DebugString())));
    }
    OP_REQUIRES(ctx, i.dim_size(0) == v.dim_size(0),
                absl::InvalidArgumentError(absl::StrCat(
                    "i and x shape doesn't match at index 0: ",
                    i.shape().DebugString(), " vs. ",
                    v.shape().DebugString())));
    Tensor y = x;  // Aliases x, as TF's kernel does...
    if (IsBatchMemory(x)) {
      // ...except over a tfray batch, which lives in Ray's store. Its
      // dtypes are numeric or bool, so its bytes are its values.
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(x.dtype(), x.shape(), &y));
      if (x.NumElements() > 0) {
        std::memcpy(y.data(), x.data(), x.TotalBytes());
      }
    }
    if (x.NumElements() > 0 && v.NumElements() > 0) {
      OP_REQUIRES_OK(ctx, ApplyAny(kind, i, v, &y));
    }
    ctx->set_output(0, y);
  }
};

// Priority 1: chosen over TF's own CPU kernels (priority 0) for every node.
REGISTER_KERNEL_BUILDER(
    Name("InplaceUpdate").Device(tensorflow::DEVICE_CPU).Priority(1),
    InplaceOp<Inplace::kUpdate>);
REGISTER_KERNEL_BUILDER(
    Name("InplaceAdd").Device(tensorflow::DEVICE_CPU).Priority(1),
    InplaceOp<Inplace::kAdd>);
REGISTER_KERNEL_BUILDER(
    Name("InplaceSub").Device(tensorflow::DEVICE_CPU).Priority(1),
    InplaceOp<Inplace::kSub>);

}  // namespace
}  // namespace tfray
