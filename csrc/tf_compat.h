// The one place for TensorFlow-version differences. Everything else in csrc/
// is written against the TensorFlow this package is built with (see
// BUILD_NOTES.md for the versions it was tried with).
#ifndef TFRAY_CSRC_TF_COMPAT_H_
#define TFRAY_CSRC_TF_COMPAT_H_

// TF's headers do not carry its release version (TF_MAJOR_VERSION comes from
// its own build flags), so setup.py passes the version it builds against.
#ifndef TFRAY_BUILT_TF_VERSION
#error "Build tfray with setup.py, which defines TFRAY_BUILT_TF_VERSION."
#endif

#ifdef EIGEN_MAX_ALIGN_BYTES
// tf.sysconfig.get_compile_flags() sets this; TF's kernels assume buffers are
// aligned to it, so only such buffers are wrapped without a copy.
#define TFRAY_TENSOR_ALIGNMENT EIGEN_MAX_ALIGN_BYTES
#else
#define TFRAY_TENSOR_ALIGNMENT 64
#endif

#endif  // TFRAY_CSRC_TF_COMPAT_H_
