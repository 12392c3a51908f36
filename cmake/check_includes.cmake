# Build-time check of one part's includes (see DsaParts.cmake): every `#include "<folder>/..."` of a
# file under ROOT/PART whose folder is a part must name an ALLOWED part. Touches STAMP when clean.
# -DROOT=<repo> -DPART=<folder> -DALLOWED=<a,b,...> -DPARTS_FILE=<file listing every part> -DSTAMP=
cmake_minimum_required(VERSION 3.25)
string(REPLACE "," ";" allowed "${ALLOWED}")
file(READ ${PARTS_FILE} parts)
string(STRIP "${parts}" parts)
file(GLOB_RECURSE files ${ROOT}/${PART}/*.h ${ROOT}/${PART}/*.cc ${ROOT}/${PART}/*.cu
     ${ROOT}/${PART}/*.cuh)
set(errors "")
foreach(file IN LISTS files)
  get_filename_component(name ${file} NAME)
  if(name STREQUAL "main.cc" OR name MATCHES "_main\\.cc$")
    continue()  # a binary's composition root: it wires the parts together
  endif()
  file(STRINGS ${file} includes REGEX "^[ \t]*#[ \t]*include[ \t]*\"[A-Za-z0-9_]+/")
  foreach(line IN LISTS includes)
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*\"([A-Za-z0-9_]+)/.*" "\\1" folder "${line}")
    if(folder IN_LIST parts AND NOT folder IN_LIST allowed)
      file(RELATIVE_PATH rel ${ROOT} ${file})
      string(APPEND errors "  ${rel}: ${line}\n")
    endif()
  endforeach()
endforeach()
if(errors)
  message(FATAL_ERROR "${PART}/ may include only ${ALLOWED}; these include other parts:\n"
                      "${errors}(the layering is declared in the top-level CMakeLists.txt)")
endif()
file(TOUCH ${STAMP})
