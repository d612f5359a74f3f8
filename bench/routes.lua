-- bench/growth's route-table workload: fenced PUTs with a strictly increasing Fencing-Token
-- (every write an admitted raise, as bench/put.lua), on a table of ROUTES routes
-- /r{k}/accounts/{id}. Arguments (after `--`): ROUTES, first token, `last` (every write to the
-- last route, k = ROUTES-1) or `spread` (k = n * 7919 % ROUTES: consecutive writes land far
-- apart in the table), and RESOURCES (default 10000) for the {id}.
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(dir .. "report.lua")

local routes, base, spread, resources, n = 1, 1, false, 10000, 0
local body = '{"balance":100}\n'

init = function(args)
  routes = tonumber(args[1]) or routes
  base = tonumber(args[2]) or base
  spread = args[3] == "spread"
  resources = tonumber(args[4]) or resources
end

request = function()
  local k = routes - 1
  if spread then
    k = (n * 7919) % routes
  end
  local token = base + n
  local id = n % resources
  n = n + 1
  return wrk.format("PUT", "/r" .. k .. "/accounts/" .. id, {
    ["Fencing-Token"] = string.format("%.0f", token),
    ["Content-Type"] = "application/json",
  }, body)
end
