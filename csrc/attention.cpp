#include "bindings.h"
namespace qspec {
void bind_attention(pybind11::module_& m) {}  // placeholder until the subsystem lands
}  // namespace qspec
