// Argument checks of the launch wrappers (bindings.cpp), done at the C++ boundary before any
// launch: the kernels trust their sizes, so a wrong stride or dimension would read or write past
// a buffer. A failed check throws std::invalid_argument, which pybind11 raises as ValueError with
// a message naming the binding and the argument: "<module>.<function>: <argument>: expected
// <what>, got <value>", or for a buffer too small "<module>.<function>: <argument> holds <n>
// bytes past its offset but the kernel reads <m> (<elements>: <the sizes and strides>)".
//
// Buffer arguments (Buf below) are a raw address (a Python int, None for null) or a torch.Tensor.
// Handed a tensor, a binding also knows its dtype, its device and how many bytes its storage
// holds past the tensor's offset, and Call::buffer checks each of them against what the kernel
// will touch given the binding's size, stride and dtype arguments. A bare address carries none
// of that: only its alignment can be checked.
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <stdexcept>
#include <string>

#include "spd_cuda.h"

namespace spd_checks {

inline void append(std::ostringstream&) {}
template <typename T, typename... Rest>
void append(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  append(os, rest...);
}

template <typename... Parts>
[[noreturn]] void fail(const char* fn, const Parts&... parts) {
  std::ostringstream os;
  os << fn << ": ";
  append(os, parts...);
  throw std::invalid_argument(os.str());
}

// Element types of the kernels' buffers; the first three are the codes of spd::DType.
enum class Elem : int { kF32 = 0, kBF16 = 1, kF16 = 2, kI64, kI32, kBool, kOther };

inline const char* elem_name(Elem e) {
  switch (e) {
    case Elem::kF32: return "float32";
    case Elem::kBF16: return "bfloat16";
    case Elem::kF16: return "float16";
    case Elem::kI64: return "int64";
    case Elem::kI32: return "int32";
    case Elem::kBool: return "bool";
    default: return "another dtype";
  }
}

inline int64_t elem_size(Elem e) {
  switch (e) {
    case Elem::kF32: case Elem::kI32: return 4;
    case Elem::kBF16: case Elem::kF16: return 2;
    case Elem::kI64: return 8;
    default: return 1;
  }
}

// The element type of a dtype code the binding has already checked to be one of spd::DType's.
inline Elem elem_of_code(int code) { return static_cast<Elem>(code); }

// One buffer argument as the binding received it.
struct Buf {
  uintptr_t addr = 0;
  bool tensor = false;       // a torch.Tensor: the fields below are known
  int64_t bytes = 0;         // the storage's bytes past the tensor's offset
  Elem elem = Elem::kOther;
  std::string dtype;         // torch's name of it (e.g. "torch.float64"), for messages
  std::string device_type;   // "cpu", "cuda", ...
  int device_index = -1;     // -1: none (a CPU tensor)
};

inline std::string device_of(const Buf& b) {
  return b.device_index < 0 ? b.device_type : b.device_type + ":" + std::to_string(b.device_index);
}

// The dtypes of torch the kernels use, looked up once (a tensor was handed in, so torch is
// imported). The references are kept for the life of the process.
inline Elem elem_of_dtype(pybind11::handle dtype) {
  static PyObject* const* const known = [] {
    static PyObject* dtypes[6];
    pybind11::module_ torch = pybind11::module_::import("torch");
    const char* names[6] = {"float32", "bfloat16", "float16", "int64", "int32", "bool"};
    for (int i = 0; i < 6; ++i) dtypes[i] = pybind11::object(torch.attr(names[i])).release().ptr();
    return dtypes;
  }();
  static const Elem elems[6] = {Elem::kF32, Elem::kBF16, Elem::kF16,
                                Elem::kI64, Elem::kI32,  Elem::kBool};
  for (int i = 0; i < 6; ++i)
    if (dtype.ptr() == known[i]) return elems[i];
  return Elem::kOther;
}

// What a tensor says about itself (with the GIL held: pybind11 converts arguments before the
// bindings release it). The bytes are the storage's past the tensor's offset, not numel: a
// view into a bigger buffer may legally be read past its own last element. A few method calls
// through interned names, since every launch pays them.
inline void read_tensor(pybind11::handle t, Buf& b) {
  namespace py = pybind11;
  struct Names {
    PyObject *data_ptr, *storage_offset, *element_size, *untyped_storage, *nbytes, *dtype,
        *is_cuda, *is_cpu, *get_device, *device;
  };
  static const Names n = {
      PyUnicode_InternFromString("data_ptr"),   PyUnicode_InternFromString("storage_offset"),
      PyUnicode_InternFromString("element_size"), PyUnicode_InternFromString("untyped_storage"),
      PyUnicode_InternFromString("nbytes"),     PyUnicode_InternFromString("dtype"),
      PyUnicode_InternFromString("is_cuda"),    PyUnicode_InternFromString("is_cpu"),
      PyUnicode_InternFromString("get_device"), PyUnicode_InternFromString("device")};
  auto call = [&](PyObject* self, PyObject* name) {
    PyObject* r = PyObject_CallMethodNoArgs(self, name);
    if (r == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(r);
  };
  auto get = [&](PyObject* name) {
    PyObject* r = PyObject_GetAttr(t.ptr(), name);
    if (r == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(r);
  };
  b.tensor = true;
  b.addr = call(t.ptr(), n.data_ptr).cast<uintptr_t>();
  const py::object dtype = get(n.dtype);
  b.elem = elem_of_dtype(dtype);
  const int64_t offset = call(t.ptr(), n.storage_offset).cast<int64_t>();
  const int64_t size = b.elem != Elem::kOther ? elem_size(b.elem)
                                              : call(t.ptr(), n.element_size).cast<int64_t>();
  const py::object storage = call(t.ptr(), n.untyped_storage);
  const int64_t nbytes = call(storage.ptr(), n.nbytes).cast<int64_t>();
  b.bytes = nbytes - offset * size;
  if (b.bytes < 0) b.bytes = 0;
  b.dtype = b.elem == Elem::kOther ? py::str(dtype).cast<std::string>()
                                   : std::string("torch.") + elem_name(b.elem);
  if (get(n.is_cuda).ptr() == Py_True) {
    b.device_type = "cuda";
    b.device_index = call(t.ptr(), n.get_device).cast<int>();
  } else if (get(n.is_cpu).ptr() == Py_True) {
    b.device_type = "cpu";
  } else {  // meta, mps, ...: named in full (only ever in a message)
    b.device_type = py::str(get(n.device)).cast<std::string>();
  }
}

// One dimension of the region a kernel touches in a buffer, outermost first: a size and the
// stride (elements) between its entries, or no stride when they lie back to back (the stride is
// then the span of the dimensions inside it). The names are the binding's arguments the values
// came from, for the message.
struct Dim {
  const char* name;
  int64_t size;
  const char* stride_name = nullptr;
  int64_t stride = 0;
  Dim(const char* n, int64_t s) : name(n), size(s) {}
  Dim(const char* n, int64_t s, const char* sn, int64_t st)
      : name(n), size(s), stride_name(sn), stride(st) {}
};

// Elements from the first to one past the last one the dims reach (no dims: one element); 0 when
// a size is 0; -1 when a size or stride is negative or the span does not fit in int64.
inline int64_t span(std::initializer_list<Dim> dims) {
  __int128 inner = 1;
  for (auto it = dims.end(); it != dims.begin();) {
    --it;
    if (it->size == 0) return 0;
    if (it->size < 0 || (it->stride_name != nullptr && it->stride < 0)) return -1;
    const __int128 stride = it->stride_name != nullptr ? (__int128)it->stride : inner;
    inner += (__int128)(it->size - 1) * stride;
    if (inner > (__int128)INT64_MAX / 16) return -1;
  }
  return (int64_t)inner;
}

enum class Access { kRead, kWrite, kReadWrite };

inline const char* verb(Access a) {
  return a == Access::kRead ? "reads" : a == Access::kWrite ? "writes" : "reads and writes";
}

// The argument that sets a buffer's element type (a dtype code or an int64 flag), for messages.
struct Why {
  const char* arg = nullptr;
  int64_t value = 0;
  bool flag = false;
};
inline Why code(const char* arg, int value) { return {arg, value, false}; }
inline Why flag(const char* arg, bool value) { return {arg, value ? 1 : 0, true}; }

// The checks of one binding call: every buffer through buffer(), which also checks that the
// tensors are all on one device, the one the kernels run on.
class Call {
 public:
  explicit Call(const char* fn) : fn_(fn) {}

  // The kernel reads / writes, from the address of `b` on, the region `dims` of elements of type
  // `elem` (`why`: the argument that chose it; none: the kernel's own type), and needs the address
  // aligned to `align` bytes (at least the element's size). Skipped for a null address: required
  // buffers are checked for null before. A tensor's dtype, device and bytes are checked too.
  void buffer(const char* name, const Buf& b, Access access, Elem elem,
              std::initializer_list<Dim> dims, Why why = {}, int64_t align = 0) {
    if (b.addr == 0) return;
    const int64_t size = elem_size(elem);
    if (align < size) align = size;
    if (b.addr % (uintptr_t)align != 0)
      fail(fn_, name, ": expected an address aligned to ", align, " bytes (", elem_name(elem),
           align > size ? ", read in 16-byte pieces" : "", "), got ", b.addr, " (", b.addr % align,
           " past a multiple)");
    if (!b.tensor) return;
    if (b.elem != elem) {
      std::ostringstream w;
      if (why.arg != nullptr)
        w << " (" << why.arg << "=" << (why.flag ? (why.value ? "True" : "False")
                                                 : std::to_string(why.value)) << ")";
      fail(fn_, name, ": the kernel ", verb(access), " ", elem_name(elem), w.str(),
           " but the tensor is ", b.dtype);
    }
    device(name, b);
    const int64_t elements = span(dims);
    const __int128 need = (__int128)elements * size;
    if (elements < 0 || (__int128)b.bytes < need) {
      std::ostringstream os;
      os << name << " holds " << b.bytes << " bytes past its offset but the kernel "
         << verb(access) << " ";
      if (elements < 0) os << "a region that overflows or has a negative size or stride";
      else os << (int64_t)need << " (" << elements << " " << elem_name(elem);
      const char* sep = elements < 0 ? " (" : ": ";
      for (const Dim& d : dims) {
        os << sep << d.name << "=" << d.size;
        sep = ", ";
        if (d.stride_name != nullptr) os << ", " << d.stride_name << "=" << d.stride;
      }
      if (elements >= 0 || dims.size() > 0) os << ")";
      fail(fn_, os.str());
    }
  }

 private:
  void device(const char* name, const Buf& b) {
#ifdef SPD_SIMT_HOST
    if (b.device_type != "cpu")
      fail(fn_, name, ": expected a CPU tensor (the host emulation runs the kernels on host "
           "memory), got one on ", device_of(b));
#else
    if (b.device_type != "cuda")
      fail(fn_, name, ": expected a CUDA tensor, got one on ", device_of(b));
#endif
    if (first_ == nullptr) {
      first_ = name;
      first_device_ = device_of(b);
#ifndef SPD_SIMT_HOST
      int current = -1;
      if (spd::current_device(&current) == 0 && b.device_index >= 0 && current != b.device_index)
        fail(fn_, name, ": the tensor is on ", first_device_, " but the kernels launch on the "
             "current CUDA device, ", current, " (launch inside torch.cuda.device(",
             b.device_index, "))");
#endif
    } else if (device_of(b) != first_device_) {
      fail(fn_, name, ": expected a tensor on ", first_device_, " (where ", first_, " is), got "
           "one on ", device_of(b));
    }
  }

  const char* fn_;
  const char* first_ = nullptr;  // the first tensor's argument and device
  std::string first_device_;
};

}  // namespace spd_checks

// Buf arguments: an int address, None (null) or a torch.Tensor (anything with untyped_storage).
namespace pybind11 {
namespace detail {
template <>
struct type_caster<spd_checks::Buf> {
  PYBIND11_TYPE_CASTER(spd_checks::Buf, const_name("int | torch.Tensor | None"));
  bool load(handle src, bool convert) {
    value = spd_checks::Buf{};
    if (src.is_none()) return true;
    if (PyBool_Check(src.ptr())) return false;  // True is no address
    // A tensor before anything with __index__: tensors have it too (one-element ones).
    if (!PyLong_Check(src.ptr()) && hasattr(src, "untyped_storage") && hasattr(src, "data_ptr")) {
      spd_checks::read_tensor(src, value);
      return true;
    }
    if (!PyLong_Check(src.ptr()) && !(convert && PyIndex_Check(src.ptr()))) return false;
    object n = reinterpret_steal<object>(PyNumber_Index(src.ptr()));
    if (!n) {
      PyErr_Clear();
      return false;
    }
    const unsigned long long a = PyLong_AsUnsignedLongLong(n.ptr());
    if (a == (unsigned long long)-1 && PyErr_Occurred()) {  // negative or too large
      PyErr_Clear();
      return false;
    }
    value.addr = (uintptr_t)a;
    return true;
  }
  static handle cast(const spd_checks::Buf& b, return_value_policy, handle) {
    return PyLong_FromUnsignedLongLong(b.addr);
  }
};
}  // namespace detail
}  // namespace pybind11

// SPD_CHECK(cond, parts...): throws naming the calling binding (SPD_FN, a const char* in scope)
// and the parts streamed together, when cond is false.
#define SPD_CHECK(cond, ...)                                 \
  do {                                                       \
    if (!(cond)) ::spd_checks::fail(SPD_FN, __VA_ARGS__);    \
  } while (0)

// An argument with a lower bound: "stride_h: expected >= 64 (D), got 32".
#define SPD_CHECK_GE(arg, bound, why) \
  SPD_CHECK((arg) >= (bound), #arg ": expected >= ", (bound), " (" why "), got ", (arg))

// A required buffer (the kernel dereferences it unconditionally).
#define SPD_CHECK_PTR(arg) SPD_CHECK((arg).addr != 0, #arg ": expected a buffer address, got null")

// A dtype code among those the kernel is compiled for (spd::DType).
#define SPD_CHECK_DTYPE(arg, lo, hi)                                                     \
  SPD_CHECK((arg) >= (lo) && (arg) <= (hi), #arg ": expected a dtype code in [", (lo), \
            ", ", (hi), "] (0 float32, 1 bfloat16, 2 float16), got ", (arg))

// A stride in elements that must keep 16-byte pieces aligned (used only when its dimension has
// more than one entry).
#define SPD_CHECK_STRIDE16(arg, used)                                                    \
  SPD_CHECK(!(used) || (arg) % 8 == 0,                                                   \
            #arg ": expected a multiple of 8 (rows read in 16-byte pieces), got ", (arg))

// Buffer `arg` (a Buf of the same name) through the call's checks (Call::buffer).
#define SPD_BUFFER(call, arg, ...) (call).buffer(#arg, arg, __VA_ARGS__)
