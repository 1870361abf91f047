// The one place for TensorFlow-version differences. Everything else in csrc/
// is written against the TensorFlow this package is built with (see
// BUILD_NOTES.md for the versions it was tried with).
#ifndef TFRAY_CSRC_TF_COMPAT_H_
#define TFRAY_CSRC_TF_COMPAT_H_

#include "tensorflow/core/framework/dataset.h"
#include "tensorflow/core/framework/dataset_options.pb.h"

// TF's headers do not carry its release version (TF_MAJOR_VERSION comes from
// its own build flags), so setup.py passes the version it builds against: as
// a string to report, and its major and minor numbers to compare.
#if !defined(TFRAY_BUILT_TF_VERSION) || !defined(TFRAY_TF_MAJOR_VERSION) || \
    !defined(TFRAY_TF_MINOR_VERSION)
#error "Build tfray with setup.py, which defines TFRAY_BUILT_TF_VERSION."
#endif

#ifdef EIGEN_MAX_ALIGN_BYTES
// tf.sysconfig.get_compile_flags() sets this; TF's kernels assume buffers are
// aligned to it, so only such buffers are wrapped without a copy.
#define TFRAY_TENSOR_ALIGNMENT EIGEN_MAX_ALIGN_BYTES
#else
#define TFRAY_TENSOR_ALIGNMENT 64
#endif

namespace tfray {
namespace compat {

#if TFRAY_TF_MAJOR_VERSION == 2 && TFRAY_TF_MINOR_VERSION < 17
// TF 2.16, tensorflow/core/framework/dataset.h: IteratorContext has no
// options() (it arrives in TF 2.17), and its Params::options is not set on
// the context a source sees. The pipeline's options are those of its
// outermost dataset (each dataset merges its inputs' options under its own),
// so they are read from the dataset of the outermost iterator, found by
// following IteratorBase::parent_, which MakeIterator sets before Initialize
// and which 2.16 keeps private with no getter. An explicit template
// instantiation may name a private member (access checking does not apply
// there, C++17 [temp.explicit]/12): no change to TF's classes, no offsets.
using ParentMember =
    const tensorflow::data::IteratorBase* tensorflow::data::IteratorBase::*;

struct ParentTag {
  friend ParentMember Get(ParentTag);
};

template <ParentMember kMember>
struct ParentAccess {
  friend ParentMember Get(ParentTag) { return kMember; }
};

template struct ParentAccess<&tensorflow::data::IteratorBase::parent_>;

// The options of the pipeline `iterator` is part of, or null if unknown.
inline const tensorflow::data::Options* PipelineOptions(
    tensorflow::data::IteratorContext* ctx,
    const tensorflow::data::IteratorBase* iterator) {
  const tensorflow::data::IteratorBase* outermost = iterator;
  while (outermost->*Get(ParentTag{}) != nullptr) {
    outermost = outermost->*Get(ParentTag{});
  }
  const auto* with_dataset =
      dynamic_cast<const tensorflow::data::DatasetBaseIterator*>(outermost);
  return with_dataset == nullptr ? nullptr
                                 : &with_dataset->dataset()->options();
}
#else
// The options of the pipeline `iterator` is part of, or null if unknown.
inline const tensorflow::data::Options* PipelineOptions(
    tensorflow::data::IteratorContext* ctx,
    const tensorflow::data::IteratorBase* iterator) {
  return ctx->options();
}
#endif

}  // namespace compat
}  // namespace tfray

#endif  // TFRAY_CSRC_TF_COMPAT_H_
