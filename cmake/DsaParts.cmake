# The parts of the system (one top-level folder each) and their layering, declared once and checked
# by the build: a part may include and link only itself and the parts it USES (and what those use).
#
#   dsa_part(<folder> USES <part>...)     declares a part, bottom-up (a USES part must exist)
#   dsa_library(<name> PART <folder> [INTERFACE] SOURCES <file>... PUBLIC <dep>... PRIVATE <dep>...)
#                                         a library of that part: include root = the repository,
#                                         so sources include "<folder>/<file>.h"
#   dsa_check_parts()                     at the end: every dsa_library links only allowed parts
#
# A wrong-way include (a part's file including "<folder>/..." of a part it may not use) fails the
# build of that part's libraries (cmake/check_includes.cmake runs whenever one of its files
# changes); a wrong-way link fails the configure step.
include_guard(GLOBAL)

function(dsa_part part)
  cmake_parse_arguments(ARG "" "" "USES" ${ARGN})
  set(allowed ${part})
  foreach(used IN LISTS ARG_USES)
    get_property(known GLOBAL PROPERTY DSA_PART_ALLOWED_${used} SET)
    if(NOT known)
      message(FATAL_ERROR "dsa_part(${part}): '${used}' is not a part declared before it")
    endif()
    get_property(used_allowed GLOBAL PROPERTY DSA_PART_ALLOWED_${used})
    list(APPEND allowed ${used_allowed})
  endforeach()
  list(REMOVE_DUPLICATES allowed)
  set_property(GLOBAL PROPERTY DSA_PART_ALLOWED_${part} "${allowed}")
  set_property(GLOBAL APPEND PROPERTY DSA_PARTS ${part})

  file(GLOB_RECURSE files CONFIGURE_DEPENDS
       ${PROJECT_SOURCE_DIR}/${part}/*.h ${PROJECT_SOURCE_DIR}/${part}/*.cc
       ${PROJECT_SOURCE_DIR}/${part}/*.cu ${PROJECT_SOURCE_DIR}/${part}/*.cuh)
  set(stamp ${CMAKE_BINARY_DIR}/layering/${part}.stamp)
  string(REPLACE ";" "," allowed_csv "${allowed}")
  add_custom_command(
    OUTPUT ${stamp}
    COMMAND ${CMAKE_COMMAND} -DROOT=${PROJECT_SOURCE_DIR} -DPART=${part}
            -DALLOWED=${allowed_csv} -DPARTS_FILE=${CMAKE_BINARY_DIR}/layering/parts.txt
            -DSTAMP=${stamp} -P ${PROJECT_SOURCE_DIR}/cmake/check_includes.cmake
    DEPENDS ${files} ${PROJECT_SOURCE_DIR}/cmake/check_includes.cmake
            ${CMAKE_BINARY_DIR}/layering/parts.txt
    COMMENT "layering of ${part}/"
    VERBATIM)
  add_custom_target(dsa_layering_${part} ALL DEPENDS ${stamp})
endfunction()

function(dsa_library name)
  cmake_parse_arguments(ARG "INTERFACE" "PART" "SOURCES;PUBLIC;PRIVATE" ${ARGN})
  get_property(known GLOBAL PROPERTY DSA_PART_ALLOWED_${ARG_PART} SET)
  if(NOT known)
    message(FATAL_ERROR "dsa_library(${name}): PART '${ARG_PART}' is not a declared part")
  endif()
  if(ARG_INTERFACE)
    add_library(${name} INTERFACE)
    target_include_directories(${name} INTERFACE ${PROJECT_SOURCE_DIR})
    target_link_libraries(${name} INTERFACE ${ARG_PUBLIC})
  else()
    add_library(${name} ${ARG_SOURCES})
    target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR})
    target_link_libraries(${name} PUBLIC ${ARG_PUBLIC} PRIVATE ${ARG_PRIVATE})
    add_dependencies(${name} dsa_layering_${ARG_PART})
  endif()
  set_property(TARGET ${name} PROPERTY DSA_PART ${ARG_PART})
  set_property(GLOBAL APPEND PROPERTY DSA_LIBRARIES ${name})
endfunction()

# Binaries and other targets of a part (add_executable and friends) call this to be checked too.
function(dsa_part_target name part)
  add_dependencies(${name} dsa_layering_${part})
endfunction()

function(dsa_check_parts)
  get_property(parts GLOBAL PROPERTY DSA_PARTS)
  file(WRITE ${CMAKE_BINARY_DIR}/layering/parts.tmp "${parts}\n")
  file(COPY_FILE ${CMAKE_BINARY_DIR}/layering/parts.tmp ${CMAKE_BINARY_DIR}/layering/parts.txt
       ONLY_IF_DIFFERENT)
  get_property(libraries GLOBAL PROPERTY DSA_LIBRARIES)
  foreach(lib IN LISTS libraries)
    get_target_property(part ${lib} DSA_PART)
    get_property(allowed GLOBAL PROPERTY DSA_PART_ALLOWED_${part})
    get_target_property(type ${lib} TYPE)
    set(deps)
    if(NOT type STREQUAL "INTERFACE_LIBRARY")
      get_target_property(deps ${lib} LINK_LIBRARIES)
    endif()
    get_target_property(interface_deps ${lib} INTERFACE_LINK_LIBRARIES)
    foreach(dep IN LISTS deps interface_deps)
      if(NOT TARGET "${dep}")
        continue()
      endif()
      get_target_property(dep_part ${dep} DSA_PART)
      if(dep_part AND NOT dep_part IN_LIST allowed)
        message(FATAL_ERROR "${lib} (part ${part}) links ${dep} of part ${dep_part}, which "
                            "${part} may not use (it may use: ${allowed}); see cmake/DsaParts.cmake")
      endif()
    endforeach()
  endforeach()
endfunction()
