# cython: language_level=3
"""Array views made with the numpy C API, for the modules that cimport it: no Python
call (a fraction of the time of slicing or ``np.broadcast_to``)."""
cimport numpy as cnp
from cpython.object cimport PyTypeObject
from cpython.ref cimport Py_INCREF

cdef extern from "numpy/arrayobject.h":
    PyTypeObject PyArray_Type
    # steals a reference to `descr`
    object PyArray_NewFromDescr(PyTypeObject* subtype, cnp.dtype descr, int nd,
                                cnp.npy_intp* dims, cnp.npy_intp* strides, void* data,
                                int flags, object obj)


cdef inline object view_of(cnp.ndarray base, int nd, cnp.npy_intp* dims,
                           cnp.npy_intp* strides, char* data, bint writable):
    """An ndarray of `base`'s dtype over `base`'s memory from `data`, with `nd` dims
    `dims` and byte `strides`, writable or read-only; it keeps `base` alive. The
    caller keeps `data`, `dims` and `strides` within `base`'s buffer."""
    descr = <object>cnp.PyArray_DESCR(base)
    Py_INCREF(descr)                        # PyArray_NewFromDescr steals it
    view = PyArray_NewFromDescr(&PyArray_Type, descr, nd, dims, strides, data,
                                cnp.NPY_ARRAY_WRITEABLE if writable else 0, None)
    cnp.set_array_base(view, base)
    return view
