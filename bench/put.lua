-- Workload (b): fenced PUTs cycling over N resources (/accounts/0 .. /accounts/N-1) with a
-- strictly increasing Fencing-Token, so every write to fencegate is an admitted raise.
-- Arguments (after `--`): N (default 10000), first token (default 1). bench/run passes the
-- current time in microseconds as the first token, so tokens keep rising from run to run.
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(dir .. "report.lua")

local resources, base, n = 10000, 1, 0
local body = '{"balance":100}\n'

init = function(args)
  resources = tonumber(args[1]) or resources
  base = tonumber(args[2]) or base
end

request = function()
  local id = n % resources
  local token = base + n
  n = n + 1
  return wrk.format("PUT", "/accounts/" .. id, {
    ["Fencing-Token"] = string.format("%.0f", token),
    ["Content-Type"] = "application/json",
  }, body)
end
